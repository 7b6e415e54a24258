"""Leaving a process whose abandoned background work may still be inside torch.

A peer that is told to stop abandons a round still in flight (its thread is a daemon, bounded waits elsewhere
make sure nothing important is lost). CPython then finalizes with that thread alive: when the thread next
takes the GIL back, CPython ends it with ``pthread_exit``, whose forced unwind runs into a ``noexcept``
destructor in torch's bindings (the one that reacquires the GIL) and ``std::terminate`` aborts the whole
process: "terminate called without an active exception", exit status -6, after the checkpoint was already
written. ``exit_process`` skips finalization in exactly that case::

    raise SystemExit(exit_process(main()))  # a console script's last line
"""

from __future__ import annotations

import multiprocessing
import os
import sys
import threading

# background threads of ours that may run torch code: rounds, heartbeats, downloads, group closing
OUR_THREADS = "swarm-"


def lingering_threads(prefix: str = OUR_THREADS) -> list[threading.Thread]:
    """Our daemon threads still running (never the calling thread)."""
    me = threading.current_thread()
    return [t for t in threading.enumerate() if t is not me and t.daemon and t.name.startswith(prefix)]


def exit_process(code: int, child_timeout_s: float = 5.0) -> int:
    """Return ``code`` when the interpreter can finalize safely; otherwise stop our forked children (what
    multiprocessing's exit hook would do), flush stdout and stderr and leave at once with ``code``."""
    if not lingering_threads():
        return code
    for child in multiprocessing.active_children():  # e.g. an averager whose shutdown timed out
        child.terminate()
        child.join(timeout=child_timeout_s)
        if child.is_alive():
            child.kill()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed or broken pipe: nothing more can be said anyway
            pass
    os._exit(code)
