"""exit_process: a process whose round thread is still inside torch exits with its own code, not SIGABRT."""

import os
import subprocess
import sys
import textwrap
import threading

from swarm.train.process_exit import exit_process, lingering_threads
from tests.process_table import alive

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

LINGERING_ROUND = textwrap.dedent(
    """
    import multiprocessing, os, sys, threading, time
    import torch
    from swarm.train.process_exit import exit_process

    def busy():  # torch ops that release and retake the GIL, as a round's decoding does
        a = torch.randn(300, 300)
        while True:
            torch.cat([a @ a, a]).clone()

    if __name__ == "__main__":
        child = multiprocessing.get_context("fork").Process(target=time.sleep, args=(600,), daemon=True)
        child.start()
        print(child.pid, flush=True)
        threading.Thread(target=busy, name="swarm-round", daemon=True).start()
        time.sleep(0.3)
        print("checkpoint written")  # buffered: must still reach the pipe
        raise SystemExit(exit_process(3))
    """
)


def test_abandoned_round_thread_does_not_turn_the_exit_into_an_abort(tmp_path):
    script = tmp_path / "lingering.py"
    script.write_text(LINGERING_ROUND)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")])}
    for _ in range(3):  # without exit_process this aborts (-6) every time on CPython 3.11
        done = subprocess.run(
            [sys.executable, str(script)], capture_output=True, text=True, timeout=60, env=env
        )
        assert done.returncode == 3, done.stderr[-2000:]
        child_pid, said = done.stdout.split()[0], done.stdout.splitlines()[1]
        assert said == "checkpoint written"
        assert not alive(int(child_pid))  # the forked child went with it


def test_without_our_threads_the_code_is_returned_for_a_normal_exit():
    other = threading.Event()
    t = threading.Thread(target=other.wait, name="not-ours", daemon=True)
    t.start()
    try:
        assert lingering_threads() == []
        assert exit_process(5) == 5
    finally:
        other.set()
        t.join(timeout=5)
