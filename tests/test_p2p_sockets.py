"""Stale p2p sockets: left by a killed process, found and removed; a listened one and an older one kept."""

import os
import socket
import time
import uuid
from pathlib import Path

from swarm.net.p2p_sockets import p2p_sockets, remove_stale_p2p_sockets, stale_p2p_sockets


def _bound(listen: bool) -> tuple[socket.socket, Path]:
    path = Path(f"/tmp/hivemind-p2pd-test-{uuid.uuid4().hex[:10]}.sock")
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(str(path))
    if listen:
        s.listen()
    old = time.time() - 10  # past the age under which a socket may be bound but not yet listened on
    os.utime(path, (old, old))
    return s, path


def test_only_sockets_that_appeared_and_nobody_listens_on_are_removed():
    kept_before, kept_path = _bound(listen=False)  # there before: never ours to remove
    before = p2p_sockets()
    dead, dead_path = _bound(listen=False)
    dead.close()  # its process died: the file stays, nobody listens
    live, live_path = _bound(listen=True)
    try:
        stale = stale_p2p_sockets(before)
        assert dead_path in stale and live_path not in stale and kept_path not in stale
        assert remove_stale_p2p_sockets(before) >= 1
        assert not dead_path.exists() and live_path.exists() and kept_path.exists()
    finally:
        for s, p in ((live, live_path), (kept_before, kept_path)):
            s.close()
            p.unlink(missing_ok=True)
        dead_path.unlink(missing_ok=True)
