"""Who may talk on the bus: CurveZMQ keys (authentication and encryption), or per-run tokens without CURVE.

The launcher makes one key pair per actor per run (:func:`generate_run_keys`) into ``RUN_DIR/curve``:
``<name>.key`` (public, z85) and ``<name>.key_secret`` (secret). Every actor uses its pair both as a server
(its bound ROUTER) and as a client (its DEALERs to peers). An actor's bound socket accepts exactly the
public keys of the run (the ``*.key`` files present), checked by a ZAP handler (pyzmq's asyncio
authenticator), so a client without an authorised key never gets a message processed; denials are counted.

An ``ActorSpec.curve`` is either ``{"keys_dir": DIR}`` (keys read from the run directory) or inline
``{"public": z85, "secret": z85, "peers": {name: z85}, "authorized": [z85, ...]}``.

A bus without CURVE (an ipc bus, or a tcp bus the topology declares ``insecure_tcp``) still binds every
connection to one actor: the launcher makes one random token per actor per run (:func:`generate_run_tokens`,
``RUN_DIR/tokens/<name>.token``, 0600, and ``<name>.digest``, its SHA-256), each actor connects with ZeroMQ's
PLAIN mechanism as its own name and token, and a bound socket's ZAP handler admits a connection only when the
token's digest is the one made for that name. The connection's User-Id is then the actor's name, so a message
whose header names another actor is refused (see ``transport.bus``). PLAIN sends the token in clear: on an ipc
bus only the run's user can reach the sockets; on an insecure tcp bus anyone who can read the network can take
it. An ``ActorSpec.tokens`` is ``{"tokens_dir": DIR}``.
"""
from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from dataclasses import dataclass, field
from typing import Any, Callable

import zmq
from zmq.auth.asyncio import AsyncioAuthenticator

from transport.files import atomic_write

__all__ = ["CurveConfig", "CurveError", "TokenConfig", "TokenError", "generate_run_keys", "generate_run_tokens",
           "start_authenticator"]


class CurveError(ValueError):
    """Key material is missing or malformed (the message names the key or file)."""


class TokenError(CurveError):
    """A run's token material is missing or malformed (the message names the file)."""


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

    credential = "CURVE key"

    def actor_of(self, user_id: str) -> str:
        """The actor a connection's ZAP User-Id (its z85 client key) was made for; "" for none."""
        return self.key_names.get(user_id, "")

    def apply_client(self, sock: zmq.Socket, peer: str) -> None:
        server_key = self.peers.get(peer)
        if server_key is None:
            raise CurveError(f"curve: no public key for peer {peer!r}")
        sock.curve_secretkey = self.secret.encode()
        sock.curve_publickey = self.public.encode()
        sock.curve_serverkey = server_key.encode()


def _read_key(path: str, length: int = 40, what: str = "curve key file", form: str = "40-character z85 key") -> str:
    try:
        with open(path, "rb") as fh:
            text = fh.read().decode(errors="replace").strip()
    except OSError as exc:
        raise CurveError(f"{what} {path}: {exc.strerror}") from None
    if len(text) != length:
        raise CurveError(f"{what} {path}: expected a {form}, found {len(text)} characters")
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
        atomic_write(os.path.join(keys_dir, f"{name}.key"), public + b"\n", mode=0o644)
        atomic_write(os.path.join(keys_dir, f"{name}.key_secret"), secret + b"\n", mode=0o600)
    return keys_dir


@dataclass
class TokenConfig:
    """This actor's bus token, and the digest of every actor's token of the run (see the module's text)."""

    name: str
    token: str
    digests: dict[str, str] = field(default_factory=dict)      # actor name -> sha256 hex of its token

    credential = "token"

    @classmethod
    def from_spec(cls, d: dict[str, Any], self_name: str) -> "TokenConfig":
        if not isinstance(d, dict) or not isinstance(d.get("tokens_dir"), str):
            raise TokenError("tokens: expected a map with tokens_dir, the run's token directory")
        tokens_dir = d["tokens_dir"]
        if not os.path.isdir(tokens_dir):
            raise TokenError(f"tokens.tokens_dir {tokens_dir!r} is not a directory")
        token = _read_key(os.path.join(tokens_dir, f"{self_name}.token"), *_TOKEN_FILE)
        digests = {fname[:-len(".digest")]: _read_key(os.path.join(tokens_dir, fname), *_TOKEN_FILE)
                   for fname in sorted(os.listdir(tokens_dir)) if fname.endswith(".digest")}
        return cls(self_name, token, digests)

    def actor_of(self, user_id: str) -> str:
        """The actor a connection authenticated as (PLAIN's User-Id is the user name ZAP admitted)."""
        return user_id if user_id in self.digests else ""

    def admits(self, username: str, password: str) -> bool:
        expected = self.digests.get(username)
        return expected is not None and hmac.compare_digest(_digest(password), expected)

    def apply_server(self, sock: zmq.Socket) -> None:
        sock.plain_server = True

    def apply_client(self, sock: zmq.Socket, peer: str) -> None:
        sock.plain_username = self.name.encode()
        sock.plain_password = self.token.encode()


_TOKEN_FILE = (64, "token file", "64 hex digits")


def _digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def generate_run_tokens(run_dir: str, names: list[str]) -> str:
    """A fresh random token per actor name under ``run_dir/tokens`` (``<name>.token``, 0600) with its digest
    (``<name>.digest``); returns that directory. Existing tokens for a name are replaced (tokens are per run)."""
    tokens_dir = os.path.join(run_dir, "tokens")
    os.makedirs(tokens_dir, mode=0o700, exist_ok=True)
    for name in names:
        if not name or "/" in name or name.startswith("."):
            raise TokenError(f"tokens: invalid actor name {name!r} for a token file")
        token = secrets.token_hex(32)
        atomic_write(os.path.join(tokens_dir, f"{name}.token"), token.encode() + b"\n", mode=0o600)
        atomic_write(os.path.join(tokens_dir, f"{name}.digest"), _digest(token).encode() + b"\n", mode=0o600)
    return tokens_dir


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


class _TokenAuthenticator(AsyncioAuthenticator):
    """ZAP for PLAIN: a run's actor by name and token (digests compared in constant time), denials reported."""

    def __init__(self, context: zmq.Context, config: TokenConfig, on_deny: Callable[[str], None] | None) -> None:
        super().__init__(context)
        self.config, self.on_deny = config, on_deny

    def _authenticate_plain(self, domain: str, username: str, password: str) -> tuple[bool, bytes]:
        if self.config.admits(username, password):
            return True, b"OK"
        if self.on_deny is not None:
            self.on_deny(f"user {username!r}")
        return False, b"not an actor of this run"


def start_authenticator(context: zmq.Context, config: "CurveConfig | TokenConfig",
                        on_deny: Callable[[str], None] | None = None) -> AsyncioAuthenticator:
    """Start the asyncio ZAP authenticator on ``context`` (one per context): accepting ``config.authorized``
    client keys (CURVE), or the run's actors by name and token (PLAIN, :class:`TokenConfig`).

    Must be called from a running event loop; returns the authenticator (call ``.stop()`` on close).
    """
    if isinstance(config, TokenConfig):
        auth = _TokenAuthenticator(context, config, on_deny)
    else:
        auth = AsyncioAuthenticator(context)
    auth.start()
    if isinstance(config, CurveConfig):
        auth.configure_curve_callback(domain="*", credentials_provider=_KeySet(config.authorized, on_deny))
    return auth
