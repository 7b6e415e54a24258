"""Bad input to the dashboard's command lines (swarm.dashboard.cli, the bootstrap's --dashboard-port): one
error line and exit code 2."""

import socket
import subprocess
import sys

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.timeout(240)


def test_bad_input_is_one_error_line_and_exit_2(tmp_path):
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    dash = [sys.executable, "-m", "swarm.dashboard.cli", "--initial-peers", "/ip4/127.0.0.1/tcp/1/p2p/x"]
    cases = [
        dash + ["--port", "70000"],
        dash + ["--port", str(port)],
        dash + ["--config", str(tmp_path / "missing.yaml")],
        dash + ["--poll-s", "0"],
        dash + ["--experts", "0"],
        dash + ["--port", "0"],  # good input, but no peer there to join
        [sys.executable, "-m", "bootstrap.main", "--dashboard-port", "70000"],
        [sys.executable, "-m", "bootstrap.main", "--dashboard-port", str(port)],
    ]
    procs = []
    try:  # side by side: each process spends most of its time starting up
        for i, cmd in enumerate(cases):
            with open(tmp_path / f"{i}.err", "w") as err:
                procs.append(subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=err))
        for i, (cmd, proc) in enumerate(zip(cases, procs, strict=True)):
            code = proc.wait(timeout=60)
            stderr = (tmp_path / f"{i}.err").read_text()
            lines = stderr.strip().splitlines()
            assert code == 2 and len(lines) == 1 and lines[0].startswith("error:"), (cmd, stderr)
    finally:
        taken.close()
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
