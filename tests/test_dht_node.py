"""A DHT node started with an identity: the same place in the DHT after a restart (real hivemind nodes)."""

from pathlib import Path

import pytest

from swarm.net.dht_node import start_dht, visible_maddrs
from swarm.net.hivemind_transport import HivemindStore

pytestmark = pytest.mark.timeout(120)


def test_a_peer_restarted_with_its_identity_does_not_make_others_stores_fail(tmp_path):
    """A peer that comes back with its identity file (``--resume``) must not sit in others' routing tables
    twice: a store would reach it twice, its second copy be refused as not newer, and hivemind then reports
    the whole store as failed (seen: a joiner's every round digest, "could not publish digest")."""
    boot = start_dht()
    nodes = [boot]
    try:
        entry = visible_maddrs(boot)
        other = start_dht(entry)
        nodes.append(other)
        first = start_dht(entry, identity_path=tmp_path / "peer.id")
        store = HivemindStore(other)
        assert store.put("t_records", [1.0], store.now() + 60, subkey=store.me, timeout=10)  # both know it
        first.shutdown()
        again = start_dht(entry, identity_path=tmp_path / "peer.id")  # the same peer id
        nodes.append(again)
        assert again.peer_id == first.peer_id
        HivemindStore(again).get("t_records", timeout=10)  # the restarted node looks around: others learn it
        results = [
            store.put(f"t_digest_{i}", [float(i)], store.now() + 60, subkey=store.me, timeout=10)
            for i in range(20)
        ]
        assert all(results), results
    finally:
        for node in nodes:
            node.shutdown()


def _sender_gone():
    raise EOFError  # what multiprocessing raises reading a request whose sender closed its resource sharer


class _RequestOfAGoneSender:
    def __reduce__(self):
        return _sender_gone, ()


def test_a_request_that_cannot_be_read_is_dropped_and_the_node_keeps_serving():
    """An averager that exits while the DHT process reads its last request made that read fail with
    EOFError, which hivemind's loop does not catch: the DHT process ended and every later call to it
    waited forever. The request is dropped; the node stays up and answers."""
    dht = start_dht()
    try:
        dht._outer_pipe.send(_RequestOfAGoneSender())  # as hivemind sends a request down its pipe
        got = dht.get("nothing-here", return_future=True).result(timeout=30)
        assert got is None and dht.is_alive()
    finally:
        dht.shutdown()


def test_the_request_pipe_still_ends_when_its_writers_are_gone():
    import multiprocessing as mp

    from swarm.net.dht_node import DHTRequests

    inner, outer = mp.Pipe(duplex=False)
    requests = DHTRequests(inner)
    outer.send(("_get", [], {"key": "k"}))
    outer.send(_RequestOfAGoneSender())
    assert requests.poll() and requests.recv() == ("_get", [], {"key": "k"})
    with pytest.raises(OSError, match="dropped a request that could not be read"):
        requests.recv()
    outer.close()  # the parent is gone: the loop must end, not spin on errors
    with pytest.raises(EOFError):
        requests.recv()


def test_a_node_removes_the_socket_its_p2p_daemon_left_behind():
    """hivemind's daemon sometimes dies without removing its socket (a peer refused for another model's
    fingerprint stops its node a second after starting it). Here it is killed outright; the node's
    shutdown finds its socket with nobody listening and removes it, and a normal shutdown leaves none."""
    import os
    import signal
    import subprocess
    import time

    for kill in (True, False):
        dht = start_dht([])
        path = dht.daemon_socket
        assert path is not None and path.exists() and path.name.startswith("hivemind-p2pd-")
        if kill:
            pids = [
                int(d.name) for d in Path("/proc").iterdir() if d.name.isdigit() and _cmdline_has(d, path)
            ]
            assert len(pids) == 1, pids
            os.kill(pids[0], signal.SIGKILL)
            deadline = time.monotonic() + 5
            while (
                time.monotonic() < deadline and subprocess.run(["kill", "-0", str(pids[0])]).returncode == 0
            ):
                time.sleep(
                    0.05
                )  # a zombie until the DHT's process reaps it: the socket file stays either way
        t = time.monotonic()
        dht.shutdown()
        assert not path.exists(), (kill, path)
        assert time.monotonic() - t < 10


def _cmdline_has(proc: Path, path: Path) -> bool:
    try:
        return f"-listen=/unix{path}".encode() in (proc / "cmdline").read_bytes()
    except OSError:  # gone meanwhile
        return False


def _daemon_environ(path: Path) -> dict[str, str]:
    procs = [d for d in Path("/proc").iterdir() if d.name.isdigit() and _cmdline_has(d, path)]
    assert len(procs) == 1, procs
    pairs = (kv.split(b"=", 1) for kv in (procs[0] / "environ").read_bytes().split(b"\0") if b"=" in kv)
    return {k.decode(): v.decode(errors="replace") for k, v in pairs}


def test_the_p2p_daemon_dials_from_fresh_ports_unless_nat_traversal_needs_its_listening_one(monkeypatch):
    """Two new peers that dial each other at once across a link with latency share one TCP connection when
    both dial from their listening ports, and both fail its handshake (benchmarks/first_contact.py): the
    daemon is told not to, in its own process only, and a user's own setting wins."""
    import os

    from swarm.net.dht_node import REUSEPORT_ENV

    monkeypatch.delenv(REUSEPORT_ENV, raising=False)
    for use_nat, user, expected in ((False, None, "false"), (True, None, None), (False, "true", "true")):
        if user is not None:
            monkeypatch.setenv(REUSEPORT_ENV, user)
        dht = start_dht([], use_nat=use_nat)
        try:
            assert _daemon_environ(dht.daemon_socket).get(REUSEPORT_ENV) == expected, (use_nat, user)
        finally:
            dht.shutdown()
        assert os.environ.get(REUSEPORT_ENV) == user  # this process's own environment is left alone
