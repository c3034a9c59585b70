"""A run's directory and what the launch writes into it before any actor starts: the inputs checked
(`inputs_ok`), the directory made or an unfinished run's found again (`make_run_dir`), the ActorSpecs with
this run's keys, ports and socket paths (`build_specs`) and the plan (`write_plan`)."""
from __future__ import annotations

import datetime as _dt
import json
import os
import sys
from pathlib import Path
from typing import Any, Sequence

import topology as topo_mod
from launch.readiness import settings_problems
from launch.report import describe
from actors.runtime.run import keep_files_private
from topology import Plan
from transport.ports import free_port


class RunDirError(OSError):
    """The run directory cannot be made or used; the message names it and why."""


def inputs_ok(plan: Plan) -> bool:
    """Check what the run's actors will read (launch/inputs.py) before any starts: print the report,
    and each problem on a line of its own; False when there is one."""
    from launch.inputs import check_inputs   # it loads torch (model directories): only when checking

    lines, problems = check_inputs(plan, launch=True)
    if lines:
        print("inputs\n" + "\n".join(f"  {line}" for line in lines), flush=True)
    if problems:
        print(f"{plan.topology.source}: {len(problems)} problem(s)\n  " + "\n  ".join(problems), file=sys.stderr)
    return not problems


def checked_run_dir(plan: Plan, requested: str | None, inputs: bool = True) -> Path | None:
    """The run directory (`make_run_dir`), once every instance's settings are checked by its actor class
    (`settings_problems`) and what the run reads (``inputs``: `inputs_ok`); None after printing why there is
    none."""
    if problems := settings_problems(plan):
        print(f"{plan.topology.source}: {len(problems)} problem(s)\n  " + "\n  ".join(problems), file=sys.stderr)
        return None
    if inputs and not inputs_ok(plan):
        return None
    try:
        return make_run_dir(plan, requested)
    except RunDirError as exc:
        print(f"{plan.topology.source}: {exc}", file=sys.stderr)
        return None


def make_run_dir(plan: Plan, requested: str | None) -> Path:
    """The requested directory; else, with `run.recover: auto`, the newest run of this topology that
    has a checkpoint but did not finish (it is resumed); else a new timestamped one. RunDirError when it
    cannot be made."""
    try:
        return _make_run_dir(plan, requested)
    except OSError as exc:
        where = exc.filename or requested or plan.topology.run_root
        raise RunDirError(f"the run directory cannot be made: {where}: {exc.strerror or exc}") from None


def _make_run_dir(plan: Plan, requested: str | None) -> Path:
    from actors.runtime.recovery import latest_checkpoint, recovering, resume_checkpoint, run_finished

    recover = recovering(plan.topology.config)
    if requested:
        path = Path(requested)
    else:
        root = Path(plan.topology.run_root) / plan.topology.name
        unfinished = sorted(d for d in root.glob("*") if d.is_dir() and latest_checkpoint(d) and not run_finished(d)) \
            if root.is_dir() and recover else []
        path = unfinished[-1] if unfinished else root / _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    if recover and path.is_dir() and not run_finished(path):
        # Checked here, once, with checksums: every actor then resumes from the same complete checkpoint.
        found = resume_checkpoint(path)
        if found is not None:
            print(f"resuming {path} from its checkpoint of step {found[0]} (run.recover: auto; "
                  f"experiment.run.recover=off starts afresh)", flush=True)
    keep_files_private()
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    if path.stat().st_mode & 0o077:   # a --run-dir that already existed
        path.chmod(0o700)
    return path.resolve()


# What `--record` turns on in every actor: tools.replay --into needs the outbound records to compare with
# and the tensors themselves to rebuild the inbound messages, not their checksums.
RECORD_SETTINGS = {"outbound": True, "tensors": "store"}


def build_specs(plan: Plan, run_dir: Path, record: bool = False) -> list[dict[str, Any]]:
    """ActorSpec dictionaries for the run: ipc paths made concrete, CurveZMQ keys (or, without CURVE, the
    actors' tokens) made for this run, message logs on for every actor with ``record``."""
    from transport.auth import generate_run_keys, generate_run_tokens
    from transport.bulk import generate_rendezvous_secret

    curve = tokens = None
    names = [i.name for i in plan.instances]
    if plan.topology.bus.curve:
        curve = {"keys_dir": generate_run_keys(str(run_dir), names)}
    else:
        tokens = {"tokens_dir": generate_run_tokens(str(run_dir), names)}
    bus = plan.topology.bus
    bus_ports = range(bus.base_port, bus.base_port + bus.port_range) if bus.transport == "tcp" else range(0)
    for link in [*plan.links.values(), *plan.worlds.values()]:
        if link.port == 0:  # `port: auto`: free now, and not one the actors' tcp bus will bind later
            host = topo_mod.resolve_host(link.master_host) if link.master_host else "127.0.0.1"
            for _ in range(100):
                if (port := free_port(host)) not in bus_ports:
                    break
            link.port = port
    specs = plan.specs(run_dir, curve=curve, tokens=tokens)
    if plan.links:
        # the links' rendezvous stores sign their values with it (transport.bulk.SignedStore)
        secret_file = generate_rendezvous_secret(run_dir)
        for spec in specs:
            for link in spec["settings"]["links"].values():
                link["secret_file"] = secret_file
    if plan.topology.bus.transport == "ipc":
        ipc_dir = run_dir / "ipc"
        longest = max(len(i.name) for i in plan.instances)
        if len(str(ipc_dir)) + longest + 8 > 100:  # unix socket paths stop at 107 bytes
            import tempfile
            # A relaunch of this run directory reuses the one its earlier launcher made (killed, it could
            # not remove it); run_local removes it at the end.
            ipc_dir = recorded_ipc_dir(run_dir) or Path(tempfile.mkdtemp(prefix="areal-ipc-"))
            (run_dir / "ipc_dir").write_text(str(ipc_dir))
        ipc_dir.mkdir(parents=True, exist_ok=True)
        ipc_dir.chmod(0o700)   # the sockets are the bus: only the run's user may reach them
        for spec in specs:
            spec["endpoint"] = spec["endpoint"].replace("{ipc_dir}", str(ipc_dir))
            spec["peers"] = {n: e.replace("{ipc_dir}", str(ipc_dir)) for n, e in spec["peers"].items()}
    if record:
        for spec in specs:
            spec["settings"]["message_log"] = dict(RECORD_SETTINGS)
    return specs


def recorded_ipc_dir(run_dir: Path) -> Path | None:
    """The bus's socket directory outside the run directory that a launcher of this run made (RUN_DIR/ipc_dir),
    if it is still there and this user's."""
    import tempfile
    try:
        path = Path((run_dir / "ipc_dir").read_text().strip())
        mine = path.stat().st_uid == os.getuid()
    except OSError:
        return None
    if mine and path.parent == Path(tempfile.gettempdir()) and path.name.startswith("areal-ipc-"):
        return path
    return None


def write_plan(plan: Plan, run_dir: Path, specs: list[dict[str, Any]], overrides: Sequence[str]) -> None:
    (run_dir / "plan.txt").write_text(describe(plan, overrides) + "\n")
    (run_dir / "plan.json").write_text(json.dumps({
        "topology": plan.topology.source, "overrides": list(overrides), "document": plan.topology.document,
        "experiment": plan.topology.experiment, "specs": specs}, indent=1, default=str))
