"""``swarm-bootstrap`` as a real process: prints how to join, keeps its identity, stops cleanly."""

import signal
import subprocess
import sys

from tests.conftest import ROOT, wait_for_maddr


def _start(tmp_path, *args):
    log = tmp_path / f"boot{len(list(tmp_path.glob('boot*.log')))}.log"
    fh = open(log, "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "bootstrap.main", *args], cwd=ROOT, stdout=fh, stderr=subprocess.STDOUT
    )
    return proc, log


def _stop(proc, sig=signal.SIGTERM):
    proc.send_signal(sig)
    try:
        return proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=10)
        raise


def test_bootstrap_prints_join_command_and_keeps_identity(tmp_path):
    ident = tmp_path / "boot.id"
    proc, log = _start(tmp_path, "--identity", str(ident), "--config", "configs/demo.yaml")
    maddr = wait_for_maddr(log, proc)
    assert maddr.startswith("/ip4/127.0.0.1/")
    assert _stop(proc, signal.SIGINT) == 0
    text = log.read_text()
    assert f"swarm-peer --config configs/demo.yaml --initial-peers {maddr}" in text
    assert "bootstrap peer stopped" in text
    peer_id = maddr.rsplit("/p2p/", 1)[1]
    proc, log = _start(tmp_path, "--identity", str(ident))
    again = wait_for_maddr(log, proc)
    assert _stop(proc) == 0
    assert again.rsplit("/p2p/", 1)[1] == peer_id


def test_bootstrap_bad_port_exit_2(tmp_path):
    res = subprocess.run(
        [sys.executable, "-m", "bootstrap.main", "--port", "70000"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 2 and res.stderr.startswith("error:")
