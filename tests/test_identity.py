"""Peer identities: one RSA key for the peer id and the records' signatures."""

import stat

import pytest
from hivemind.p2p import PeerID
from hivemind.p2p.p2p_daemon import P2P

from swarm.net.identity import IdentityError, PeerIdentity, peer_id_of_owner


def test_an_identity_file_keeps_the_peer_id_libp2p_derives_from_it(tmp_path):
    path = tmp_path / "peer.id"
    me = PeerIdentity.load_or_create(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert PeerIdentity.load_or_create(path).peer_id == me.peer_id  # a restart keeps it
    assert me.peer_id == PeerID.from_identity(path.read_bytes()).to_base58()
    P2P.generate_identity(str(tmp_path / "hivemind.id"))  # hivemind's own files (``--identity``) load too
    theirs = PeerIdentity.load(tmp_path / "hivemind.id")
    assert theirs.peer_id == PeerID.from_identity((tmp_path / "hivemind.id").read_bytes()).to_base58()


def test_a_records_owner_tag_names_its_writer_and_anything_else_names_nobody():
    me, other = PeerIdentity.create(), PeerIdentity.create()
    assert peer_id_of_owner(me.owner_subkey) == me.peer_id != peer_id_of_owner(other.owner_subkey)
    assert peer_id_of_owner(me.owner_subkey.decode()) == me.peer_id
    for junk in (me.peer_id, b"[owner:ssh-rsa AAAA]", me.owner_subkey + b"x", b"[owner:]", None, 7, [1]):
        assert peer_id_of_owner(junk) is None


@pytest.mark.parametrize("content", [b"", b"not a key", b"\x08\x00\x12\x03abc"])
def test_a_file_that_is_not_an_identity_is_one_clear_error(tmp_path, content):
    (tmp_path / "bad.id").write_bytes(content)
    with pytest.raises(IdentityError, match="bad.id: not a peer identity file"):
        PeerIdentity.load(tmp_path / "bad.id")
