"""A rehearsal of a cluster run's control plane on one machine: ``python -m tools.rehearse TOPOLOGY --scale S``.

The real buffer, parameter server, reward actors, trainer actor and rollout actors of the topology, at a
fraction S of its fan-out, are launched through the launcher's multi-node path (its plans per node and one
``tools.node_agent`` per node, each node a loopback address of this machine), with stand-ins only where the
GPUs would be: SGLang servers whose steps take what the planner's cost model says (tools/rehearse/engine.py,
served by testsupport/sglang_standin.py) and a trainer whose step sleeps the modelled step
(tools/rehearse/trainer.py). The simulation of the same scaled run (tools/plan/sim.py) is compared with it,
figure by figure (`sim.agreement`). docs/plan.md describes it and its measurements.
"""
