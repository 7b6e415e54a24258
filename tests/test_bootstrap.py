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


def test_a_new_swarm_key_is_named_in_the_join_command_and_a_dashboard_without_it_is_refused(tmp_path):
    key = tmp_path / "swarm.key"
    proc, log = _start(tmp_path, "--new-swarm", "--swarm-key", str(key))
    try:
        maddr = wait_for_maddr(log, proc)
        assert f"--initial-peers {maddr} --swarm-key {key}" in log.read_text()
        first = key.read_bytes()
        # a second --new-swarm never overwrites a key (it may be a live swarm's): one error line, exit 2
        again = subprocess.run(
            [sys.executable, "-m", "bootstrap.main", "--new-swarm", "--swarm-key", str(key)],
            cwd=ROOT, capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert again.returncode == 2 and "never overwritten" in again.stderr and key.read_bytes() == first
        # a node with another key (or none) is not let in: one error line that names the key, exit 2
        (tmp_path / "other.key").write_text("swarm-key v1 " + "ab" * 32 + "\n")
        for extra in (["--swarm-key", str(tmp_path / "other.key")], []):
            res = subprocess.run(
                [sys.executable, "-m", "swarm.dashboard.cli", "--initial-peers", maddr, "--port", "0", *extra],
                cwd=ROOT, capture_output=True, text=True, timeout=90,
            )  # fmt: skip
            errors = [ln for ln in res.stderr.splitlines() if ln.startswith("error:")]
            assert res.returncode == 2 and len(errors) == 1 and "--swarm-key" in errors[0], res.stderr[-2000:]
    finally:
        assert _stop(proc) == 0
