"""The swarm key: the shared secret that makes a node a member, and an optional allowlist of peers.

    key = SwarmKey.create(); key.write("swarm.key")          # swarm-bootstrap --new-swarm
    key = SwarmKey.load("swarm.key", allow="peers.txt")       # every member: --swarm-key (and --allow-peers)
    token = key.member_token(peer_id)                          # proves membership, bound to that peer id
    key.admits(peer_id, token)                                 # what a group checks before any tensor

With a key, the DHT answers only requests signed with it (``SwarmKeyAuthorizer``) and averaging groups take
only members whose gathered info carries their token (``HivemindGroup``). A token is an HMAC of the peer id:
libp2p authenticates peer ids on every stream, so a token seen on the wire cannot be used by another peer.
The allowlist (peer ids, one per line) closes the swarm further: only the listed peers' records are read and
only they join groups. The key file is one line, ``swarm-key v1 <64 hex digits>``, readable by its owner only.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from dataclasses import dataclass
from pathlib import Path

HEADER = "swarm-key v1"
KEY_BYTES = 32
TOKEN_BYTES = 16


class SwarmKeyError(ValueError):
    """A key or allowlist file that cannot be used. The message is one line."""


@dataclass(frozen=True)
class SwarmKey:
    """See the module docstring."""

    secret: bytes
    allowlist: frozenset[str] | None = None  # peer ids; None: every holder of the key

    def __post_init__(self) -> None:
        if len(self.secret) != KEY_BYTES:
            raise SwarmKeyError(f"a swarm key is {KEY_BYTES} bytes, not {len(self.secret)}")

    def __repr__(self) -> str:  # never the secret, in a log or a traceback
        return (
            f"SwarmKey(id={self.key_id}, allowlist={None if self.allowlist is None else len(self.allowlist)})"
        )

    @classmethod
    def create(cls) -> SwarmKey:
        return cls(secrets.token_bytes(KEY_BYTES))

    @classmethod
    def load(cls, path: str | Path, allow: str | Path | None = None) -> SwarmKey:
        head, _, hexkey = _read(path, "the swarm key").strip().rpartition(" ")
        try:
            secret = bytes.fromhex(hexkey) if head == HEADER else b""
        except ValueError:
            secret = b""
        if len(secret) != KEY_BYTES:
            raise SwarmKeyError(f"{path}: not a swarm key file (expected '{HEADER} <64 hex digits>')")
        return cls(secret, _allowlist(allow) if allow is not None else None)

    def write(self, path: str | Path) -> None:
        """Write the key file, owner-only; an existing file is never replaced (it may be a live swarm's)."""
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            raise SwarmKeyError(f"{path} exists: a swarm key is never overwritten") from None
        except OSError as e:
            raise SwarmKeyError(f"{path}: cannot write the swarm key ({e.strerror})") from None
        with os.fdopen(fd, "w") as f:
            f.write(f"{HEADER} {self.secret.hex()}\n")
            f.flush()
            os.fsync(f.fileno())

    @property
    def key_id(self) -> str:
        """A short public name of the key (for logs and the dashboard): not the secret."""
        return hashlib.sha256(b"swarm-key-id:" + self.secret).hexdigest()[:12]

    def mac(self, purpose: bytes, message: bytes) -> bytes:
        return hmac.new(self.secret, purpose + b"\0" + message, hashlib.sha256).digest()

    def member_token(self, peer_id: str) -> bytes:
        return self.mac(b"member", peer_id.encode())[:TOKEN_BYTES]

    def allows(self, peer_id: str) -> bool:
        return self.allowlist is None or peer_id in self.allowlist

    def admits(self, peer_id: str, token: object) -> bool:
        """Whether ``peer_id`` may take part: its token is right and it is on the allowlist (if any)."""
        ok = isinstance(token, bytes) and hmac.compare_digest(token, self.member_token(peer_id))
        return ok and self.allows(peer_id)


def _read(path: str | Path, what: str) -> str:
    try:
        return Path(path).read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise SwarmKeyError(f"{path}: cannot read {what} ({getattr(e, 'strerror', None) or e})") from None


def _allowlist(path: str | Path) -> frozenset[str]:
    peers = [ln.split("#")[0].strip() for ln in _read(path, "the allowlist").splitlines()]
    peers = [p for p in peers if p]
    bad = [p for p in peers if not (p.isalnum() and 30 <= len(p) <= 80)]
    if bad or not peers:
        raise SwarmKeyError(
            f"{path}: one peer id per line expected" + (f", not {bad[0][:40]!r}" if bad else "")
        )
    return frozenset(peers)


def add_swarm_key_args(ap) -> None:
    """``--swarm-key`` and ``--allow-peers``, alike on every command that joins a swarm."""
    ap.add_argument(
        "--swarm-key", default=None, metavar="FILE", help="the swarm's key: only its holders take part"
    )
    ap.add_argument(
        "--allow-peers", default=None, metavar="FILE", help="closed swarm: the peer ids allowed, one per line"
    )


def swarm_key_from_args(args) -> SwarmKey | None:
    """The key the arguments name (None: a swarm without key). Raises SwarmKeyError (one line)."""
    if args.allow_peers and not args.swarm_key:
        raise SwarmKeyError("--allow-peers needs --swarm-key")
    return SwarmKey.load(args.swarm_key, allow=args.allow_peers) if args.swarm_key else None


def swarm_key_args(args) -> list[str]:
    """The same arguments, for a command printed or started with them."""
    out = ["--swarm-key", args.swarm_key] if args.swarm_key else []
    return out + (["--allow-peers", args.allow_peers] if args.allow_peers else [])
