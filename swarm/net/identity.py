"""A peer's identity: one RSA key that is both its libp2p peer id and the signature on its records.

    me = PeerIdentity.load_or_create("run/peer.id")   # the same peer id after a restart
    me = PeerIdentity.create()                         # a new one (a throwaway file for p2pd is made)
    me.peer_id, me.owner_subkey                        # "QmXyz...", b"[owner:ssh-rsa AAAA...]"
    peer_id_of_owner(me.owner_subkey) == me.peer_id    # what a reader derives from a record's subkey

hivemind's ``RSASignatureValidator`` makes a record whose subkey holds ``[owner:<public key>]`` writable only
by that key's holder. Because the same key is the peer's libp2p identity, a reader derives the writer's peer
id from the subkey itself: nobody can write a record that reads as another peer's. The key file is
libp2p's protobuf encoding, as hivemind writes it (``--identity``), readable by the owner only.
"""

from __future__ import annotations

import hashlib
import os
import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.p2p import PeerID
from hivemind.proto import crypto_pb2
from hivemind.utils.crypto import RSAPrivateKey, RSAPublicKey

_OWNER_RE = re.compile(rb"^\[owner:(ssh-rsa [A-Za-z0-9+/=]{64,2048})\]$")


class IdentityError(ValueError):
    """An identity file that cannot be used. The message is one line."""


@dataclass(frozen=True)
class PeerIdentity:
    """See the module docstring."""

    key: RSAPrivateKey

    @classmethod
    def create(cls) -> PeerIdentity:
        return cls(RSAPrivateKey())

    @classmethod
    def load(cls, path: str | Path) -> PeerIdentity:
        try:
            der = crypto_pb2.PrivateKey.FromString(Path(path).read_bytes()).data
            loaded = serialization.load_der_private_key(der, password=None)
        except Exception as e:  # a protobuf, DER or file error: the user needs the file named
            raise IdentityError(f"{path}: not a peer identity file ({type(e).__name__})") from None
        if not isinstance(loaded, rsa.RSAPrivateKey):
            raise IdentityError(f"{path}: the identity is not an RSA key")
        key = RSAPrivateKey.__new__(RSAPrivateKey)  # hivemind's wrapper has no constructor from a key
        key._private_key = loaded
        return cls(key)

    @classmethod
    def load_or_create(cls, path: str | Path) -> PeerIdentity:
        if Path(path).exists():
            return cls.load(path)
        me = cls.create()
        try:
            me.write(path)
        except OSError as e:
            raise IdentityError(f"{path}: cannot write the identity ({e.strerror})") from None
        return me

    def write(self, path: str | Path) -> None:
        """Write the key file (owner-only), atomically: a crash never leaves half a key."""
        path = Path(path)
        blob = crypto_pb2.PrivateKey(key_type=crypto_pb2.KeyType.RSA, data=self.key.to_bytes())
        tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(blob.SerializeToString())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)

    @property
    def owner_subkey(self) -> bytes:
        return RSASignatureValidator(self.key).local_public_key

    @property
    def peer_id(self) -> str:
        return _peer_id(self.key.get_public_key().to_bytes())

    def validator(self) -> RSASignatureValidator:
        return RSASignatureValidator(self.key)


def peer_id_of_owner(subkey: object) -> str | None:
    """The peer id whose key signs records under ``subkey`` (``[owner:<ssh-rsa key>]``), or None if the
    subkey is not an owner tag (an unsigned record: anyone could have written it)."""
    if isinstance(subkey, str):
        subkey = subkey.encode()
    if not isinstance(subkey, bytes):
        return None
    found = _OWNER_RE.match(subkey)
    return _peer_id(found.group(1)) if found else None


@lru_cache(maxsize=4096)
def _peer_id(ssh_public_key: bytes) -> str | None:
    try:
        public = RSAPublicKey.from_bytes(ssh_public_key)._public_key
    except Exception:
        return None
    der = public.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    encoded = crypto_pb2.PublicKey(key_type=crypto_pb2.RSA, data=der).SerializeToString()
    # libp2p's peer id of an RSA key: the sha2-256 multihash (code 0x12, 32 bytes) of its protobuf encoding
    return PeerID(b"\x12\x20" + hashlib.sha256(encoded).digest()).to_base58()
