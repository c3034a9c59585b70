"""CurveZMQ authentication and encryption for the bus.

The launcher makes one key pair per actor per run (:func:`generate_run_keys`) into ``RUN_DIR/curve``:
``<name>.key`` (public, z85) and ``<name>.key_secret`` (secret). Every actor uses its pair both as a server
(its bound ROUTER) and as a client (its DEALERs to peers). An actor's bound socket accepts exactly the
public keys of the run (the ``*.key`` files present), checked by a ZAP handler (pyzmq's asyncio
authenticator), so a client without an authorised key never gets a message processed; denials are counted.

An ``ActorSpec.curve`` is either ``{"keys_dir": DIR}`` (keys read from the run directory) or inline
``{"public": z85, "secret": z85, "peers": {name: z85}, "authorized": [z85, ...]}``.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Callable

import zmq

__all__ = ["CurveConfig", "CurveError", "generate_run_keys", "start_authenticator"]


class CurveError(ValueError):
    """Key material is missing or malformed (the message names the key or file)."""


@dataclass
class CurveConfig:
    public: str
    secret: str
    peers: dict[str, str] = field(default_factory=dict)        # peer name -> its public key
    authorized: list[str] = field(default_factory=list)        # client public keys we accept
    key_names: dict[str, str] = field(default_factory=dict)    # public key -> the actor it was made for

    @classmethod
    def from_spec(cls, d: dict[str, Any], self_name: str, peer_names: list[str] | None = None) -> "CurveConfig":
        if not isinstance(d, dict):
            raise CurveError(f"curve: expected a map, got {type(d).__name__}")
        if "keys_dir" in d:
            return cls.from_keys_dir(d["keys_dir"], self_name, peer_names)
        for key in ("public", "secret"):
            if not isinstance(d.get(key), str) or len(d[key]) != 40:
                raise CurveError(f"curve.{key}: expected a 40-character z85 key")
        peers = d.get("peers") or {}
        authorized = d.get("authorized") or []
        if not isinstance(peers, dict) or not isinstance(authorized, list):
            raise CurveError("curve.peers must be a map and curve.authorized a list")
        return cls(d["public"], d["secret"], dict(peers), list(authorized), {k: n for n, k in peers.items()})

    @classmethod
    def from_keys_dir(cls, keys_dir: str, self_name: str, peer_names: list[str] | None = None) -> "CurveConfig":
        if not os.path.isdir(keys_dir):
            raise CurveError(f"curve.keys_dir {keys_dir!r} is not a directory")
        public = _read_key(os.path.join(keys_dir, f"{self_name}.key"))
        secret = _read_key(os.path.join(keys_dir, f"{self_name}.key_secret"))
        all_public = {}
        for fname in sorted(os.listdir(keys_dir)):
            if fname.endswith(".key"):
                all_public[fname[:-4]] = _read_key(os.path.join(keys_dir, fname))
        peers = {n: k for n, k in all_public.items() if peer_names is None or n in peer_names}
        return cls(public, secret, peers, sorted(set(all_public.values())), {k: n for n, k in all_public.items()})

    def to_dict(self) -> dict[str, Any]:
        return {"public": self.public, "secret": self.secret, "peers": dict(self.peers),
                "authorized": list(self.authorized)}

    def apply_server(self, sock: zmq.Socket) -> None:
        sock.curve_server = True
        sock.curve_secretkey = self.secret.encode()
        sock.curve_publickey = self.public.encode()

    def apply_client(self, sock: zmq.Socket, peer: str) -> None:
        server_key = self.peers.get(peer)
        if server_key is None:
            raise CurveError(f"curve: no public key for peer {peer!r}")
        sock.curve_secretkey = self.secret.encode()
        sock.curve_publickey = self.public.encode()
        sock.curve_serverkey = server_key.encode()


def _read_key(path: str) -> str:
    try:
        with open(path, "rb") as fh:
            text = fh.read().decode().strip()
    except OSError as exc:
        raise CurveError(f"curve key file {path}: {exc.strerror}") from None
    if len(text) != 40:
        raise CurveError(f"curve key file {path}: expected a 40-character z85 key, found {len(text)} characters")
    return text


def generate_run_keys(run_dir: str, names: list[str]) -> str:
    """Make a fresh key pair per actor name under ``run_dir/curve``; returns that directory.

    Secret files are created 0600. Existing keys for a name are replaced (keys are per run).
    """
    keys_dir = os.path.join(run_dir, "curve")
    os.makedirs(keys_dir, mode=0o700, exist_ok=True)
    for name in names:
        if not name or "/" in name or name.startswith("."):
            raise CurveError(f"curve: invalid actor name {name!r} for a key file")
        public, secret = zmq.curve_keypair()
        _write(os.path.join(keys_dir, f"{name}.key"), public, 0o644)
        _write(os.path.join(keys_dir, f"{name}.key_secret"), secret, 0o600)
    return keys_dir


def _write(path: str, data: bytes, mode: int) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "wb") as fh:
        fh.write(data + b"\n")
    os.replace(tmp, path)


class _KeySet:
    """ZAP credentials provider: allow the configured client keys, count and report the rest."""

    def __init__(self, keys: list[str], on_deny: Callable[[str], None] | None) -> None:
        self.keys = {k.encode() if isinstance(k, str) else k for k in keys}
        self.on_deny = on_deny

    def callback(self, domain: str, key: bytes) -> bool:
        ok = key in self.keys
        if not ok and self.on_deny is not None:
            self.on_deny(key.decode(errors="replace"))
        return ok


def start_authenticator(context: zmq.Context, config: CurveConfig,
                        on_deny: Callable[[str], None] | None = None):
    """Start the asyncio ZAP authenticator on ``context`` (one per context) accepting ``config.authorized``.

    Must be called from a running event loop; returns the authenticator (call ``.stop()`` on close).
    """
    from zmq.auth.asyncio import AsyncioAuthenticator

    auth = AsyncioAuthenticator(context)
    auth.start()
    auth.configure_curve_callback(domain="*", credentials_provider=_KeySet(config.authorized, on_deny))
    return auth
