"""What another user of the machine can do to a run, with nothing but the Python standard library.

`python tools/bench/intruder.py < PLAN.json` prints one JSON object. `tools.bench chaos` runs it as another
uid (a user it creates) against a live run, so it imports nothing of this repository and nothing outside the
standard library: the other user can read neither the run directory nor, often, the interpreter the run
uses. The bench hands it, in PLAN.json, what an intruder learns by scanning ports and reading the code: the
bus endpoints, the rendezvous ports, and the frames of the messages to send (built with the project's own
encoder, since the intruder has no msgpack).

Bus: a ZMTP 3.0 client (https://rfc.zeromq.org/spec/23/, over tcp or a unix socket) that connects as a DEALER
and speaks whatever
mechanism the actor's socket announces in its greeting: NULL, or PLAIN with a guessed user and password; it
cannot speak CURVE without one of the run's keys, and says so. It then sends each message's frames and waits
for a reply.

Rendezvous: torch's TCPStore wire protocol (torch/csrc/distributed/c10d/TCPStoreBackend.hpp, torch 2.13:
one query-type byte, the 0x3C85F7CE validation number, strings and values as a little-endian u64 length and
the bytes; the Python API stores its keys under a leading "/"): the intruder tries each store from another
address of the machine (the network's view), then over loopback lists its keys and writes forged values
where the next formation of each link will read its members' addresses.
"""
from __future__ import annotations

import json
import os
import re
import socket
import struct
import sys
from typing import Any

GREETING_LEN = 64
_MORE, _LONG, _COMMAND = 0x01, 0x02, 0x04


class Refused(Exception):
    """The actor's socket would not talk to the intruder (what it said, if anything)."""


# ------------------------------------------------------------------------------------------------ ZMTP

def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    out = bytearray()
    while len(out) < n:
        chunk = sock.recv(n - len(out))
        if not chunk:
            raise Refused("the actor closed the connection")
        out += chunk
    return bytes(out)


def _frame(body: bytes, flags: int) -> bytes:
    if len(body) > 255:
        return bytes([flags | _LONG]) + struct.pack(">Q", len(body)) + body
    return bytes([flags, len(body)]) + body


def _read_frame(sock: socket.socket) -> tuple[int, bytes]:
    flags = _recv_exactly(sock, 1)[0]
    size = struct.unpack(">Q", _recv_exactly(sock, 8))[0] if flags & _LONG else _recv_exactly(sock, 1)[0]
    return flags, _recv_exactly(sock, size)


def _command(name: bytes, data: bytes) -> bytes:
    return _frame(bytes([len(name)]) + name + data, _COMMAND)


def _properties(**props: str) -> bytes:
    out = b""
    for key, value in props.items():
        name, val = key.replace("_", "-").encode(), value.encode()
        out += bytes([len(name)]) + name + struct.pack(">I", len(val)) + val
    return out


def _command_name(body: bytes) -> tuple[bytes, bytes]:
    """A command's name and data. The ERROR command of libzmq 4.3.5 starts with the bytes 5e 52 52 4f 52 (seen
    on the wire), not 05 45 52 52 4f 52 ("\\x05ERROR"): the name's length and first letter are one byte."""
    if body[:5] == b"\x5eRROR":
        return b"ERROR", body[5:]
    return body[1:1 + body[0]] if body else b"", body[1 + body[0]:] if body else b""


def _expect(sock: socket.socket, wanted: bytes) -> None:
    flags, body = _read_frame(sock)
    name, data = _command_name(body)
    if not flags & _COMMAND or name != wanted:
        said = f"ERROR {data[1:1 + data[0]].decode(errors='replace')}" if name == b"ERROR" and data else \
            name.decode(errors="replace") or "a message"
        raise Refused(f"the actor answered {said} instead of {wanted.decode()}")


def open_endpoint(endpoint: str, timeout: float) -> socket.socket:
    """A stream connected to a ZeroMQ endpoint: ``tcp://host:port`` or ``ipc://path`` (a unix socket)."""
    if endpoint.startswith("ipc://"):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(timeout)
        try:
            sock.connect(endpoint.removeprefix("ipc://"))
        except OSError:
            sock.close()
            raise
        return sock
    host, port = endpoint.removeprefix("tcp://").rsplit(":", 1)
    return socket.create_connection((host, int(port)), timeout=timeout)


def zmtp_connect(endpoint: str, timeout: float, user: str, password: str) -> tuple[socket.socket, str]:
    """A DEALER connection to a ROUTER; returns it and the mechanism used. Raises Refused."""
    sock = open_endpoint(endpoint, timeout)
    try:
        sock.sendall(b"\xff" + b"\x00" * 8 + b"\x7f" + b"\x03")      # signature, major version 3
        theirs = _recv_exactly(sock, GREETING_LEN)
        mechanism = theirs[12:32].rstrip(b"\x00")
        if mechanism not in (b"NULL", b"PLAIN"):
            raise Refused(f"the socket speaks {mechanism.decode(errors='replace')}, which needs one of the run's keys")
        sock.sendall(b"\x00" + mechanism.ljust(20, b"\x00") + b"\x00" + b"\x00" * 31)
        if mechanism == b"PLAIN":
            sock.sendall(_command(b"HELLO", bytes([len(user)]) + user.encode() + bytes([len(password)])
                                  + password.encode()))
            _expect(sock, b"WELCOME")
            sock.sendall(_command(b"INITIATE", _properties(Socket_Type="DEALER")))
        else:
            sock.sendall(_command(b"READY", _properties(Socket_Type="DEALER")))
        _expect(sock, b"READY")
        return sock, mechanism.decode()
    except (Refused, OSError):
        sock.close()
        raise


def zmtp_send(sock: socket.socket, frames: list[bytes]) -> None:
    sock.sendall(b"".join(_frame(f, _MORE if i < len(frames) - 1 else 0) for i, f in enumerate(frames)))


def zmtp_recv(sock: socket.socket) -> list[bytes]:
    """One message (its frames); commands in between (heartbeats) are skipped."""
    frames = []
    while True:
        flags, body = _read_frame(sock)
        if flags & _COMMAND:
            continue
        frames.append(body)
        if not flags & _MORE:
            return frames


def spoof(target: dict[str, Any], timeout: float, user: str, password: str) -> dict[str, Any]:
    """Send one message to an actor's bus; what the actor let through."""
    out: dict[str, Any] = {"name": target["name"], "handshake": None, "reply": None}
    try:
        sock, mechanism = zmtp_connect(target["endpoint"], timeout, user, password)
    except Refused as exc:
        out["handshake"] = f"refused: {exc}"
        return out
    except OSError as exc:
        out["handshake"] = f"unreachable: {exc.strerror or type(exc).__name__}"
        return out
    out["handshake"] = f"accepted ({mechanism})"
    try:
        zmtp_send(sock, [bytes.fromhex(f) for f in target["frames"]])
        if target.get("wants_reply"):
            out["reply"] = [f.hex() for f in zmtp_recv(sock)]
    except (Refused, OSError) as exc:
        out["reply_error"] = str(exc)
    finally:
        sock.close()
    return out


# ---------------------------------------------------------------------------------------- TCPStore

_VALIDATE, _SET, _GET, _PING, _LIST_KEYS = 0, 1, 3, 13, 17
_MAGIC = 0x3C85F7CE


def _blob(data: bytes) -> bytes:
    return struct.pack("<Q", len(data)) + data


class StoreClient:
    def __init__(self, host: str, port: int, timeout: float) -> None:
        self.sock = socket.create_connection((host, port), timeout=timeout)
        self.sock.sendall(struct.pack("<BI", _VALIDATE, _MAGIC) + struct.pack("<BI", _PING, 7))
        if struct.unpack("<I", _recv_exactly(self.sock, 4))[0] != 7:
            raise Refused("the store did not answer its ping")

    def _read_blob(self) -> bytes:
        return _recv_exactly(self.sock, struct.unpack("<Q", _recv_exactly(self.sock, 8))[0])

    def keys(self) -> list[str]:
        self.sock.sendall(bytes([_LIST_KEYS]))
        return [self._read_blob().decode(errors="replace") for _ in range(struct.unpack("<Q", _recv_exactly(self.sock, 8))[0])]

    def get(self, key: str) -> bytes:
        self.sock.sendall(bytes([_GET]) + _blob(key.encode()))
        return self._read_blob()

    def set(self, key: str, value: bytes) -> None:
        self.sock.sendall(bytes([_SET]) + _blob(key.encode()) + _blob(value))

    def close(self) -> None:
        self.sock.close()


def forged_keys(keys: list[str]) -> list[str]:
    """Where the next formation of each link reads its members' addresses: epoch e+1 of every link's newest
    epoch e, one key per rank but the master's (``/<link>/epoch<e>/<n>/<rank>``)."""
    newest: dict[str, tuple[int, set[str]]] = {}
    for key in keys:
        m = re.fullmatch(r"/(.+)/epoch(\d+)/(\d+)/(\d+)", key)
        if m:
            link, epoch = m.group(1), int(m.group(2))
            seen = newest.get(link, (-1, set()))
            if epoch > seen[0]:
                newest[link] = (epoch, {f"{m.group(3)}/{m.group(4)}"})
            elif epoch == seen[0]:
                seen[1].add(f"{m.group(3)}/{m.group(4)}")
    return sorted(f"/{link}/epoch{epoch + 1}/{slot}" for link, (epoch, slots) in newest.items()
                  for slot in slots if not slot.endswith("/0"))


def probe_store(store: dict[str, Any], timeout: float) -> dict[str, Any]:
    out: dict[str, Any] = {"link": store["link"], "port": store["port"]}
    try:
        socket.create_connection((store["network_host"], store["port"]), timeout=timeout).close()
        out["from_network"] = f"connected via {store['network_host']}"
    except OSError as exc:
        out["from_network"] = f"refused via {store['network_host']}: {exc.strerror or exc}"
    try:
        client = StoreClient(store["host"], store["port"], timeout)
    except (OSError, Refused) as exc:
        out["loopback"] = f"refused: {exc}"
        return out
    try:
        keys = client.keys()
        out["keys_read"] = len(keys)
        out["forged"] = forged_keys(keys)
        for key in out["forged"]:
            client.set(key, b"an address of the intruder's choosing")
        out["loopback"] = "connected"
    except (OSError, Refused) as exc:
        out["loopback"] = f"failed: {exc}"
    finally:
        client.close()
    return out


def main() -> int:
    plan = json.load(sys.stdin)
    timeout = float(plan.get("timeout_s", 3.0))
    user, password = plan.get("user", "evaluator"), plan.get("password", "0" * 64)
    report: dict[str, Any] = {"uid": os.getuid()}
    if plan.get("control"):
        report["control"] = spoof(plan["control"], timeout, user, password)
    report["messages"] = [spoof(t, timeout, user, password) for t in plan.get("messages", [])]
    report["stores"] = [probe_store(s, timeout) for s in plan.get("stores", [])]
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
