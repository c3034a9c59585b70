"""The SGLang server process an engine launches: started with ``python -m sglang.launch_server``, waited for
until healthy (bounded), watched, and restarted with backoff after a death (its own supervisor: the actor
supervisor restarts actors, and a rollout must outlive its server's deaths). The engine hears each death
and return (:data:`ServerEvents`)."""
from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from actors.runtime.run import parent_death_signal
from transport.ports import free_port

from .sglang_routes import ROUTED_EXPERTS_FLAG, ServerEvents, SGLangLaunchError, health_probe_s

__all__ = ["LaunchConfig", "SGLangServer"]

# Whether a URL answers HTTP 200 within a timeout (the engine's HTTP client's probe).
Probe = Callable[[str, float], Awaitable[bool]]


@dataclasses.dataclass
class LaunchConfig:
    """How to start the server; ``command`` is the module runner (tests name the stand-in server there)."""

    model_path: str
    command: list[str] = dataclasses.field(default_factory=lambda: [sys.executable, "-m", "sglang.launch_server"])
    host: str = "127.0.0.1"
    port: int = 0                      # 0: a free port, chosen anew for every start
    tp: int = 1
    ep: int = 1                        # expert-parallel ranks among the tp ones (MoE models; SGLang's --ep-size)
    mem_fraction_static: float | None = None
    dtype: str | None = None
    seed: int | None = None
    extra_args: list[str] = dataclasses.field(default_factory=list)
    env: dict[str, str] = dataclasses.field(default_factory=dict)
    log_path: str | None = None        # server stdout/stderr (appended); default: a temp file
    health_timeout_s: float = 600.0    # bound on waiting for /health after a start
    max_restarts: int = 5
    backoff_s: float = 1.0             # doubled after each restart, up to backoff_max_s
    backoff_max_s: float = 30.0
    # LoRA (model.lora): the adapters' largest rank and their target modules (SGLang sizes its adapter memory
    # pool with them), and {name: adapter directory} loaded at launch (a restart comes back with the adapter).
    lora_rank: int = 0
    lora_targets: tuple[str, ...] = ()
    lora_paths: dict[str, str] = dataclasses.field(default_factory=dict)
    # Routing replay (algo.routing_replay: r3 on a mixture-of-experts model): the server captures the experts
    # each token was routed to, which /generate then returns.
    routed_experts: bool = False

    def args(self, port: int, weight_version: int) -> list[str]:
        args = [*self.command, "--model-path", self.model_path, "--host", self.host, "--port", str(port),
                "--tp-size", str(self.tp), "--skip-tokenizer-init", "--weight-version", str(weight_version)]
        if self.ep > 1:
            args += ["--ep-size", str(self.ep)]
        if self.mem_fraction_static is not None:
            args += ["--mem-fraction-static", str(self.mem_fraction_static)]
        if self.dtype:
            args += ["--dtype", self.dtype]
        if self.seed is not None:
            args += ["--random-seed", str(self.seed)]
        if self.lora_rank:
            args += ["--enable-lora", "--max-lora-rank", str(self.lora_rank), "--lora-target-modules",
                     *self.lora_targets]
            if self.lora_paths:
                args += ["--lora-paths", *(f"{name}={path}" for name, path in self.lora_paths.items())]
        if self.routed_experts:
            args.append(ROUTED_EXPERTS_FLAG)
        return args + list(self.extra_args)


class SGLangServer:
    """One server process: start, wait for health (bounded), watch, restart with backoff after a death."""

    def __init__(self, config: LaunchConfig, probe: Probe, on_event: ServerEvents | None = None) -> None:
        self.config, self.probe = config, probe
        self.proc: subprocess.Popen | None = None
        self.url = ""
        self.restarts = 0
        self.on_event = on_event
        self.weight_version = 0
        self.model_path = config.model_path
        self.lora_paths = dict(config.lora_paths)   # the adapter a restart comes back with
        self._log_file: Any = None
        self._watch: asyncio.Task | None = None
        self._stopping = False
        self.healthy = asyncio.Event()
        self.failed: BaseException | None = None
        self.starts = 0                     # launches so far; a request remembers the one it was sent to
        self.changed = asyncio.Condition()  # notified on every state change (healthy, died, failed)

    async def died(self, starts: int, grace_s: float = 5.0) -> bool:
        """Whether the process of launch number `starts` is gone; a request that lost its connection gives
        the process `grace_s` to finish dying (a killed process resets connections before it is reaped)."""
        proc = self.proc
        if self.starts != starts or proc is None:
            return True
        try:
            await asyncio.to_thread(proc.wait, grace_s)
        except subprocess.TimeoutExpired:
            return False
        return True

    async def _notify(self) -> None:
        async with self.changed:
            self.changed.notify_all()

    async def start(self, weight_version: int) -> None:
        self.weight_version = weight_version
        await self._launch()
        self._watch = asyncio.ensure_future(self._watcher())

    async def _launch(self) -> None:
        cfg = self.config
        port = cfg.port or free_port(cfg.host)
        self.url = f"http://{cfg.host}:{port}"
        if cfg.log_path:
            Path(cfg.log_path).parent.mkdir(parents=True, exist_ok=True)
            self._log_file = open(cfg.log_path, "ab")
        else:
            import tempfile
            self._log_file = tempfile.NamedTemporaryFile(prefix="sglang-server-", suffix=".log", delete=False)
        args = dataclasses.replace(cfg, model_path=self.model_path, lora_paths=self.lora_paths).args(
            port, self.weight_version)
        env = {**os.environ, **cfg.env}
        try:
            self.proc = subprocess.Popen(args, stdout=self._log_file, stderr=subprocess.STDOUT, env=env,
                                         start_new_session=True, preexec_fn=parent_death_signal())
        except OSError as exc:
            raise SGLangLaunchError(f"could not start {args[:4]}: {exc}") from exc
        self.starts += 1
        await self._wait_healthy(cfg.health_timeout_s)
        await self._notify()

    def log_tail(self, chars: int = 2000) -> str:
        if self._log_file is None:
            return ""
        try:
            self._log_file.flush()
            with open(self._log_file.name, "rb") as f:
                f.seek(0, os.SEEK_END)
                f.seek(max(0, f.tell() - chars))
                return f.read().decode(errors="replace")
        except OSError:
            return ""

    async def _wait_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        delay = 0.05
        while True:
            if self.proc is not None and self.proc.poll() is not None:
                raise SGLangLaunchError(f"SGLang server exited with code {self.proc.returncode} before it was "
                                        f"healthy ({' '.join(self.proc.args[:4])} ...); log tail:\n{self.log_tail()}")
            # /health generates a token: a second at least, more while the server warms up (health_probe_s)
            if await self.probe(self.url + "/health", health_probe_s(self.config.env)):
                self.healthy.set()
                return
            if time.monotonic() > deadline:
                await self.kill()
                raise SGLangLaunchError(f"SGLang server at {self.url} was not healthy within {timeout_s:g} s; "
                                        f"log tail:\n{self.log_tail()}")
            await asyncio.sleep(delay)  # polling a process we cannot be notified by
            delay = min(delay * 2, 1.0)

    async def _watcher(self) -> None:
        backoff = self.config.backoff_s
        while not self._stopping:
            proc = self.proc
            assert proc is not None
            code = await asyncio.to_thread(proc.wait)
            if self._stopping:
                return
            self.healthy.clear()
            await self._notify()
            if self.on_event is not None:
                await self.on_event("died", self.restarts)
            if self.restarts >= self.config.max_restarts:
                self.failed = SGLangLaunchError(f"SGLang server at {self.url} died (exit {code}) and was "
                                                f"restarted {self.restarts} times already (max_restarts)")
                await self._notify()  # waiters see `failed`
                return
            await asyncio.sleep(backoff)  # restart backoff
            backoff = min(backoff * 2, self.config.backoff_max_s)
            self.restarts += 1
            try:
                await self._launch()
            except SGLangLaunchError as exc:
                self.failed = exc
                await self._notify()
                return
            if self.on_event is not None:
                await self.on_event("restarted", self.restarts)

    async def kill(self) -> None:
        proc = self.proc
        if proc is not None and proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                await asyncio.to_thread(proc.wait, 20.0)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                await asyncio.to_thread(proc.wait, 10.0)

    async def stop(self) -> None:
        self._stopping = True
        await self.kill()
        if self._watch is not None:
            await asyncio.gather(self._watch, return_exceptions=True)
        if self._log_file is not None:
            self._log_file.close()
