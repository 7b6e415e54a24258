"""The unix socket files of p2p daemons and their clients, and removing those a killed process left.

    before = p2p_sockets()
    ...                                  # start processes, SIGKILL some of them (a churn test, a benchmark)
    remove_stale_p2p_sockets(before)     # what the killed ones could not remove themselves

hivemind's p2pd and each P2P client bind a socket under /tmp and remove it when they shut down; a process
killed with SIGKILL cannot (NOTES.md), so whoever killed it removes what it left.
"""

from __future__ import annotations

import socket
import time
from pathlib import Path

YOUNG_S = 2.0  # a socket bound but not yet listened on is milliseconds old: left alone


def p2p_sockets() -> set[Path]:
    return set(Path("/tmp").glob("hivemind-p2p*.sock"))


def stale_p2p_sockets(before: set[Path]) -> set[Path]:
    """Sockets that appeared since ``before`` and that nobody listens on: a p2p daemon or client that died
    without removing its own. A process running beside this one (pytest -n) listens on its socket; one that
    has bound but not yet listened is a few milliseconds old, so young sockets are left."""
    stale = set()
    for path in p2p_sockets() - before:
        try:
            old = time.time() - path.stat().st_mtime > YOUNG_S
        except OSError:  # removed meanwhile
            continue
        if old and not_listened(path):
            stale.add(path)
    return stale


def not_listened(path: Path) -> bool:
    """Whether the socket file is there and nobody listens on it (its owner died without removing it)."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.connect(str(path))
    except ConnectionRefusedError:
        return True
    except OSError:  # gone, or another error: not ours to judge
        return False
    finally:
        s.close()
    return False


def remove_stale_p2p_sockets(before: set[Path]) -> int:
    """Remove the ``stale_p2p_sockets`` (a killed process's); returns how many."""
    stale = stale_p2p_sockets(before)
    for path in stale:
        path.unlink(missing_ok=True)
    return len(stale)
