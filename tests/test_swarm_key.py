"""The swarm key and its allowlist: files, tokens, and who they admit (pure)."""

import stat

import pytest

from swarm.net.swarm_key import SwarmKey, SwarmKeyError

A, B = "QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N", "QmSoLnSGccFuZQJzRadHn95W2CrSFmZuTdDWP8HXaHca9z"


def test_a_key_file_round_trips_is_owner_only_and_is_never_overwritten(tmp_path):
    key = SwarmKey.create()
    key.write(tmp_path / "swarm.key")
    assert stat.S_IMODE((tmp_path / "swarm.key").stat().st_mode) == 0o600
    assert SwarmKey.load(tmp_path / "swarm.key") == key
    with pytest.raises(SwarmKeyError, match="never overwritten"):
        SwarmKey.create().write(tmp_path / "swarm.key")
    assert SwarmKey.load(tmp_path / "swarm.key") == key
    assert key.secret.hex() not in repr(key) and key.key_id in repr(key)


@pytest.mark.parametrize(
    "text",
    ["", "swarm-key v1", "swarm-key v1 abcd", "swarm-key v2 " + "00" * 32, "swarm-key v1 " + "zz" * 32],
)
def test_a_file_that_is_not_a_key_is_one_clear_error(tmp_path, text):
    (tmp_path / "k").write_text(text)
    with pytest.raises(SwarmKeyError, match="not a swarm key file"):
        SwarmKey.load(tmp_path / "k")
    with pytest.raises(SwarmKeyError, match="cannot read"):
        SwarmKey.load(tmp_path / "absent")


def test_a_token_admits_only_the_peer_it_was_made_for_and_only_with_the_same_key():
    key, other = SwarmKey.create(), SwarmKey.create()
    a, b = A, B
    assert key.admits(a, key.member_token(a))
    assert not key.admits(b, key.member_token(a))  # seen on the wire, it is no use to another peer
    assert not key.admits(a, other.member_token(a)) and not key.admits(a, None) and not key.admits(a, "x")


def test_an_allowlist_admits_only_the_listed_peers(tmp_path):
    a, b = A, B
    SwarmKey.create().write(tmp_path / "swarm.key")
    (tmp_path / "peers.txt").write_text(f"# the closed swarm\n{a}  # alice\n\n")
    key = SwarmKey.load(tmp_path / "swarm.key", allow=tmp_path / "peers.txt")
    assert key.allowlist == {a} and key.admits(a, key.member_token(a))
    assert not key.admits(b, key.member_token(b)) and not key.allows(b)
    for bad in ("", "not a peer id!\n"):
        (tmp_path / "bad.txt").write_text(bad)
        with pytest.raises(SwarmKeyError, match="one peer id per line"):
            SwarmKey.load(tmp_path / "swarm.key", allow=tmp_path / "bad.txt")
