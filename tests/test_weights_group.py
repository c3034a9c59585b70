"""A weights group whose member hangs must not take down the trainer (gloo, real processes).

Trainer rank 0 hosts SGLang's weight-update group (actors/weight_sync/servers.py, ServerGroupHost) with two
servers' ranks; one server joins and then hangs. The push of version 1 fails within the group's timeout
(every weights-group collective is waited for with a deadline), the group is torn down, the trainer's own
world (rank 0 and rank 1) goes on with a collective, and version 2 goes out on the next group, formed
without the hung member, arriving whole at the healthy server.
"""
from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import time
import traceback
from typing import Any

import torch
import torch.distributed as dist

from actors.engines.sglang_group import join_weight_group
from actors.weights import weights_hash
from testsupport.sglang_standin import receive_bucket
from transport.bulk import bucket_metas, pack_buckets
from transport.ports import free_port

CTX = mp.get_context("fork")
# The host waits this (+5 s) for every member to join: with 3 s, a member forked beside a loaded machine's
# other runs joined after the host had given up, and the test saw a failed join instead of a hung member.
GROUP_TIMEOUT_S = 10.0
WAIT_S = 60.0
BUCKET_FLOATS = 8 << 20   # 32 MiB: more than the sockets buffer, so a send to a member that reads nothing blocks


def _bucket(version: int) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(version)
    return [("a", torch.randn(BUCKET_FLOATS, generator=g)), ("b", torch.randn(7, 3, generator=g))]


def _server(rank: int, ports: Any, out: Any, hang: Any, release: Any) -> None:
    """A server's rank: joins each epoch it is given and receives versions 1 then 2, or, told to hang,
    joins and then does nothing until released (the test's end)."""
    try:
        torch.set_num_threads(1)
        for epoch, world, version in ((0, 3, 1), (1, 2, 2)):
            port = ports.get(timeout=WAIT_S)
            if port is None:   # left out of this epoch
                return
            pg = join_weight_group("127.0.0.1", port, rank, world, f"w-e{epoch}", "gloo", timeout_s=WAIT_S)
            if hang:
                release.wait(WAIT_S)
                return
            bucket = receive_bucket(pg, bucket_metas(_bucket(version)), flattened=True)
            out.put((f"server{rank}", {f"v{version}": weights_hash(bucket)}))
    except BaseException:
        out.put((f"server{rank}", {"error": traceback.format_exc()}))


def _trainer_rank(rank: int, world_port: int, server_ports: list[Any], out: Any) -> None:
    try:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{world_port}", rank=rank, world_size=2,
                                timeout=datetime.timedelta(seconds=WAIT_S))
        if rank == 0:
            out.put(("trainer0", _host_pushes(server_ports)))
        # the trainer's world after the failed push: both ranks still in it
        total = torch.tensor([rank + 1.0])
        dist.all_reduce(total)
        out.put((f"trainer{rank}", {"world_sum": float(total)}))
        dist.destroy_process_group()
    except BaseException:
        out.put((f"trainer{rank}", {"error": traceback.format_exc()}))


def _host_pushes(server_ports: list[Any]) -> dict[str, Any]:
    from actors.weight_sync.servers import ServerGroupHost

    host = ServerGroupHost("127.0.0.1", "gloo", GROUP_TIMEOUT_S)
    result: dict[str, Any] = {}
    port = host.host(0, 3, "w-e0")
    for q in server_ports:
        q.put(port)
    t0 = time.monotonic()
    try:
        host.broadcast(1, 0, pack_buckets([_bucket(1)]), "w")
        result["v1"] = "sent"
    except Exception as exc:
        result["v1"] = f"{type(exc).__name__}: {exc}"
    result["v1_failed_after_s"] = time.monotonic() - t0
    result["hosted_after_failure"] = host.epoch
    port = host.host(1, 2, "w-e1")   # the next epoch, of the healthy server only
    server_ports[0].put(port)
    server_ports[1].put(None)
    host.broadcast(2, 1, pack_buckets([_bucket(2)]), "w")
    result["v2"] = "sent"
    host.close()
    return result


def test_a_hung_member_fails_the_push_in_time_and_the_trainer_world_sends_the_next_version() -> None:
    out = CTX.Queue()
    server_ports = [CTX.Queue(), CTX.Queue()]
    release = CTX.Event()
    world_port = free_port()
    procs = [CTX.Process(target=_trainer_rank, args=(r, world_port, server_ports, out), daemon=True) for r in (0, 1)]
    procs += [CTX.Process(target=_server, args=(1, server_ports[0], out, False, release), daemon=True),
              CTX.Process(target=_server, args=(2, server_ports[1], out, True, release), daemon=True)]
    for p in procs:
        p.start()
    results: dict[str, dict[str, Any]] = {}
    try:
        deadline = time.monotonic() + 2 * WAIT_S
        while not ("world_sum" in results.get("trainer0", {}) and "world_sum" in results.get("trainer1", {})
                   and "v2" in results.get("server1", {})):
            name, part = out.get(timeout=max(0.1, deadline - time.monotonic()))
            results.setdefault(name, {}).update(part)
            assert "error" not in part, part["error"]
    finally:
        release.set()
        for p in procs:
            p.join(WAIT_S)
            if p.is_alive():
                p.kill()
    trainer0 = results["trainer0"]
    assert "timed out" in trainer0["v1"].lower(), trainer0     # the hung member failed the push ...
    assert trainer0["v1_failed_after_s"] < WAIT_S, trainer0    # ... by the group's deadline, not the test's
    assert trainer0["hosted_after_failure"] is None            # the broken group was torn down
    assert trainer0["v2"] == "sent"
    assert trainer0["world_sum"] == results["trainer1"]["world_sum"] == 3.0   # the trainer's world lives on
    assert results["server1"]["v2"] == weights_hash(_bucket(2))                # version 2 arrived whole
    assert [p.exitcode for p in procs] == [0, 0, 0, 0]


def test_an_nccl_weights_group_is_built_to_survive_a_failed_member(monkeypatch) -> None:
    """torch's default (3) has NCCL's watchdog kill the process on a timed-out collective; a weights group is
    built with 2, which aborts only that group (the group itself needs a GPU: here its construction fails
    after the setting is made)."""
    from actors.engines.sglang_routes import SGLangError
    monkeypatch.setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "3")
    try:
        join_weight_group("127.0.0.1", free_port(), 0, 1, "nccl-check", "nccl", timeout_s=10)
    except SGLangError:
        pass   # no GPU or no NCCL here
    assert os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "2"
