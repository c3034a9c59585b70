"""The first process of a sandboxed agent program (actors/rollout/agent.py, ``agent.sandbox``): it makes the
rollout's endpoint reachable at ``http://127.0.0.1:PORT/v1`` inside the sandbox and runs the program.

The sandbox has a network namespace of its own (loopback only) and the endpoint's unix socket bound in: the
only way out. An OpenAI client speaks TCP to a ``base_url``, so this relays every connection to
``127.0.0.1:PORT`` onto that socket, byte for byte, then runs the program with the environment it was given
(``OPENAI_BASE_URL``, ``OPENAI_API_KEY``, ``AGENT_TASK``) and exits with its status. The settings come in a
JSON file, not the command line: bwrap's command line is visible to every user of the host, and it would
carry the episode's key.

A program that is a Python file run as this interpreter runs (``{python} -I FILE ARGS``) runs in this process,
as ``python3 -I FILE`` would run it: a second interpreter's start is most of an episode's CPU outside the model
(tools/bench/agent.py --program). Sharing the relay's process gives it nothing it lacked: the relay holds no
more than the program's own key and the socket the program could reach directly.

Runs under the sandbox's system Python: the standard library only, nothing of the project.
    python3 -I agent_relay.py SETTINGS.json
"""
from __future__ import annotations

import json
import os
import runpy
import socket
import subprocess
import sys
import threading
import traceback


def pump(source: socket.socket, sink: socket.socket) -> None:
    """Copy one direction until it closes, then close both ways (the other pump ends on it)."""
    try:
        while True:
            data = source.recv(1 << 16)
            if not data:
                break
            sink.sendall(data)
    except OSError:
        pass
    for s in (source, sink):
        try:
            s.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


def relay(listener: socket.socket, unix_path: str) -> None:
    while True:
        client, _ = listener.accept()
        upstream = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            upstream.connect(unix_path)
        except OSError:
            client.close()
            upstream.close()
            continue
        for a, b in ((client, upstream), (upstream, client)):
            threading.Thread(target=pump, args=(a, b), daemon=True).start()


def run_here(argv: list[str], env: dict[str, str]) -> int:
    """Run the Python file ``argv[0]`` with ``argv`` and ``env`` as its ``__main__``: its exit status, as the
    interpreter would give it (an uncaught exception: its traceback and 1; ``sys.exit(text)``: the text and 1)."""
    os.environ.clear()
    os.environ.update(env)
    sys.argv = list(argv)
    try:
        runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            return (exc.code or 0) % 256
        print(exc.code, file=sys.stderr)
        return 1
    except BaseException as exc:   # noqa: BLE001 - the program's failure is its exit status, as in its own interpreter
        frames = exc.__traceback__   # from the program's own frames on, without the relay's and runpy's
        while frames is not None and frames.tb_frame.f_code.co_filename != argv[0]:
            frames = frames.tb_next
        traceback.print_exception(type(exc), exc, frames or exc.__traceback__)
        return 1
    return 0


def main(settings_path: str) -> int:
    with open(settings_path, encoding="utf-8") as f:
        settings = json.load(f)
    listener = socket.create_server(("127.0.0.1", int(settings["port"])))
    threading.Thread(target=relay, args=(listener, settings["socket"]), daemon=True).start()
    env = {**settings["env"], "PATH": "/usr/bin:/bin", "HOME": "/tmp", "LANG": "C.UTF-8"}
    argv = settings["argv"]
    if len(argv) >= 3 and argv[:2] == [sys.executable, "-I"] and not argv[2].startswith("-"):
        return run_here(argv[2:], env)
    try:
        return subprocess.run(argv, env=env, stdin=subprocess.DEVNULL).returncode % 256
    except OSError as exc:
        print(f"agent program could not start: {exc}", file=sys.stderr)
        return 127


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
