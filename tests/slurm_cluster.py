"""A real SLURM cluster on loopback for tests: munged, slurmctld and one slurmd per fake node, run as
plain background processes under a scratch directory.

Fake node ``n<i>`` gets its own address 127.0.0.(10+i) in /etc/hosts, so launchers can resolve it and
each node can bind its own address. Needs root (the daemons, /etc/hosts) and Debian's slurm-wlm + munge;
:func:`unavailable_reason` says why a machine cannot run it, and :func:`ensure_installed` installs the
packages with apt when root. Everything is torn down by pid, and /etc/hosts is restored.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from transport.ports import free_port

HOSTS = Path("/etc/hosts")
FAKE_GPU_DEVICES = ["/dev/null", "/dev/zero", "/dev/full", "/dev/urandom"]
PACKAGES = ["slurm-wlm", "munge"]


def unavailable_reason() -> str | None:
    """None when a local cluster can run here, otherwise why not."""
    if os.geteuid() != 0:
        return "the local SLURM cluster needs root (slurmd daemons, /etc/hosts entries for fake nodes)"
    if shutil.which("slurmctld") and shutil.which("munged"):
        return None
    if not shutil.which("apt-get"):
        return "slurm-wlm/munge are not installed and there is no apt-get to install them"
    return None


def ensure_installed(timeout: float = 300) -> None:
    """Install slurm-wlm and munge with apt when missing (CI does this in tools/install.sh --test)."""
    if shutil.which("slurmctld") and shutil.which("munged"):
        return
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    subprocess.run(["apt-get", "update", "-qq"], check=True, timeout=timeout, env=env, capture_output=True)
    subprocess.run(["apt-get", "install", "-y", "-qq", "--no-install-recommends", *PACKAGES], check=True,
                   timeout=timeout, env=env, capture_output=True)


def _wait(predicate, timeout: float, what: str, interval: float = 0.1) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() >= deadline:
            raise TimeoutError(f"local SLURM cluster: {what} not reached within {timeout:g} s")
        time.sleep(interval)


class SlurmCluster:
    """``with SlurmCluster(scratch, nodes=2) as cluster: subprocess.run([...], env=cluster.env)``"""

    def __init__(self, scratch: str | Path | None = None, nodes: int = 2, cpus_per_node: int = 2,
                 gpus_per_node: int = 0):
        # munged runs as the munge user and must reach its files: pytest's tmp dirs (0700) will not do
        self._own_dir = scratch is None
        self.dir = Path(tempfile.mkdtemp(prefix="areal-slurm-") if scratch is None else scratch).resolve()
        os.chmod(self.dir, 0o755)
        self.nodes = [f"n{i}" for i in range(1, nodes + 1)]
        self.cpus = cpus_per_node
        # Fake GPUs: slurmd 22.05 refuses a count-only gpu GRES ("gres/gpu count reported lower than configured
        # (0 < 2)"), so each one is a character device every machine has. TaskPlugin=task/none confines nothing.
        if gpus_per_node > len(FAKE_GPU_DEVICES):
            raise ValueError(f"at most {len(FAKE_GPU_DEVICES)} fake GPUs per node")
        self.gpus = gpus_per_node
        self.conf = self.dir / "slurm.conf"
        self.env = dict(os.environ, SLURM_CONF=str(self.conf))
        for key in list(self.env):  # a test run inside someone's allocation must not leak into ours
            if key.startswith("SLURM_") and key != "SLURM_CONF":
                del self.env[key]
        self._hosts_added: list[str] = []

    # -- bring-up --------------------------------------------------------------------------------

    def start(self) -> "SlurmCluster":
        d = self.dir
        for sub in ("ctld", "log", "munge"):
            (d / sub).mkdir(parents=True, exist_ok=True)
        munge = d / "munge"
        self._run(["mungekey", "-c", "-f", "-k", str(munge / "munge.key")])
        self._run(["chown", "-R", "munge:munge", str(munge)])
        os.chmod(munge, 0o755)  # 700 would lock non-root clients out of the socket
        self._run(["runuser", "-u", "munge", "--", "munged", "--force", f"--key-file={munge / 'munge.key'}",
                   f"--socket={munge / 'munge.sock'}", f"--pid-file={munge / 'munged.pid'}",
                   f"--log-file={munge / 'munged.log'}", f"--seed-file={munge / 'munged.seed'}"])
        _wait(lambda: (munge / "munge.sock").exists(), 10, "munged socket")
        ctld_port = free_port()
        lines = [
            "ClusterName=areal_test", "SlurmctldHost=localhost", f"SlurmctldPort={ctld_port}",
            "SlurmUser=root", "SlurmdUser=root", "AuthType=auth/munge", f"AuthInfo=socket={munge / 'munge.sock'}",
            "CredType=cred/munge", f"StateSaveLocation={d / 'ctld'}", f"SlurmdSpoolDir={d}/d-%n",
            f"SlurmctldPidFile={d / 'slurmctld.pid'}", f"SlurmdPidFile={d}/slurmd-%n.pid",
            f"SlurmctldLogFile={d / 'log' / 'slurmctld.log'}", f"SlurmdLogFile={d}/log/slurmd-%n.log",
            "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none", "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core", "SlurmdParameters=config_overrides",
            "AccountingStorageType=accounting_storage/none", "JobAcctGatherType=jobacct_gather/none",
            "JobCompType=jobcomp/none", "MpiDefault=none", "MailProg=/bin/true", "ReturnToService=2",
            "KillWait=5", "InactiveLimit=0",
        ]
        if self.gpus:
            lines.append("GresTypes=gpu")
            (d / "gres.conf").write_text(f"Name=gpu File={','.join(FAKE_GPU_DEVICES[:self.gpus])}\n")
        for i, name in enumerate(self.nodes, start=1):
            lines.append(f"NodeName={name} NodeHostname=localhost NodeAddr={self.address(name)} "
                         f"Port={free_port()} CPUs={self.cpus} RealMemory=1000"
                         + (f" Gres=gpu:{self.gpus}" if self.gpus else ""))
        lines.append("PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP")
        self.conf.write_text("\n".join(lines) + "\n")
        self._add_hosts()
        self._run(["slurmctld"])
        for name in self.nodes:
            (d / f"d-{name}").mkdir(exist_ok=True)
            self._run(["slurmd", "-N", name])
        _wait(self._all_idle, 60, f"{len(self.nodes)} idle nodes")
        return self

    def address(self, node: str) -> str:
        return f"127.0.0.{10 + int(node[1:])}"

    def _all_idle(self) -> bool:
        out = subprocess.run(["sinfo", "-h", "-N", "-t", "idle", "-o", "%N"], env=self.env, capture_output=True,
                             text=True, timeout=30)
        return out.returncode == 0 and set(out.stdout.split()) >= set(self.nodes)

    def _add_hosts(self) -> None:
        text = HOSTS.read_text()
        present = {ln.split()[1] for ln in text.splitlines() if len(ln.split()) >= 2 and not ln.startswith("#")}
        add = [f"{self.address(n)} {n}" for n in self.nodes if n not in present]
        if add:
            # append in place: Docker bind-mounts /etc/hosts, so it cannot be replaced by a rename
            with HOSTS.open("a") as fh:
                fh.write(("" if text.endswith("\n") else "\n") + "\n".join(add) + "\n")
            self._hosts_added = add

    def _run(self, cmd: list[str]) -> None:
        res = subprocess.run(cmd, env=self.env, capture_output=True, text=True, timeout=60)
        if res.returncode != 0:
            raise RuntimeError(f"local SLURM cluster: {' '.join(cmd)} failed ({res.returncode}): "
                               f"{res.stderr.strip() or res.stdout.strip()}")

    # -- teardown --------------------------------------------------------------------------------

    def stop(self) -> None:
        pid_files = [self.dir / f"slurmd-{n}.pid" for n in self.nodes]
        pid_files += [self.dir / "slurmctld.pid", self.dir / "munge" / "munged.pid"]
        pids = []
        for f in pid_files:
            try:
                pid = int(f.read_text().strip())
                os.kill(pid, 15)
                pids.append(pid)
            except (OSError, ValueError):
                pass

        def gone() -> bool:
            return not any(os.path.exists(f"/proc/{p}") and "zombie" not in
                           Path(f"/proc/{p}/status").read_text().lower() for p in pids if _exists(p))
        try:
            _wait(gone, 15, "daemons exit")
        except TimeoutError:
            for p in pids:
                try:
                    os.kill(p, 9)
                except OSError:
                    pass
        if self._hosts_added:
            keep = [ln for ln in HOSTS.read_text().splitlines() if ln not in self._hosts_added]
            with HOSTS.open("w") as fh:  # rewrite in place, never replace the file
                fh.write("\n".join(keep) + "\n")
            self._hosts_added = []
        if self._own_dir:
            shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> "SlurmCluster":
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _exists(pid: int) -> bool:
    try:
        Path(f"/proc/{pid}/status").read_text()
        return True
    except OSError:
        return False
