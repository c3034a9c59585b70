"""The first process of a sandboxed agent program (actors/rollout/agent.py, ``agent.sandbox``): it makes the
rollout's endpoint reachable at ``http://127.0.0.1:PORT/v1`` inside the sandbox and runs the program.

The sandbox has a network namespace of its own (loopback only) and the endpoint's unix socket bound in: the
only way out. An OpenAI client speaks TCP to a ``base_url``, so this relays every connection to
``127.0.0.1:PORT`` onto that socket, byte for byte, then runs the program with the environment it was given
(``OPENAI_BASE_URL``, ``OPENAI_API_KEY``, ``AGENT_TASK``) and exits with its status. The settings come in a
JSON file, not the command line: bwrap's command line is visible to every user of the host, and it would
carry the episode's key.

Runs under the sandbox's system Python: the standard library only, nothing of the project.
    python3 -I agent_relay.py SETTINGS.json
"""
from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading


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


def main(settings_path: str) -> int:
    with open(settings_path, encoding="utf-8") as f:
        settings = json.load(f)
    listener = socket.create_server(("127.0.0.1", int(settings["port"])))
    threading.Thread(target=relay, args=(listener, settings["socket"]), daemon=True).start()
    env = {**settings["env"], "PATH": "/usr/bin:/bin", "HOME": "/tmp", "LANG": "C.UTF-8"}
    try:
        return subprocess.run(settings["argv"], env=env, stdin=subprocess.DEVNULL).returncode % 256
    except OSError as exc:
        print(f"agent program could not start: {exc}", file=sys.stderr)
        return 127


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
