"""The local trainer interrupted: SIGKILL at random moments never breaks the latest checkpoint, SIGTERM and
SIGINT checkpoint and stop with 130, and a Ctrl+C that Python swallowed still stops training."""

import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest

from swarm.train import load_checkpoint
from swarm.train.checkpoint import latest_checkpoint
from swarm.train.metrics_log import read_metrics
from tests.conftest import ROOT, peer_cmd, reap, wait_until
from tests.trainer_fixtures import _losses, _solo_args


def test_sigkill_at_random_moments_never_breaks_latest(config, tmp_path):
    """A checkpoint every step; SIGKILL at moments spread over a step once training runs, three times."""
    run = tmp_path / "run"
    latest, step = None, 0
    for delay in (0.01, 0.04, 0.07):
        cmd = peer_cmd(*_solo_args(config, run, "--max-steps", "100000", "--resume", "--set",
                                   "train.checkpoint_every=1", "--set", "train.eval_every=1000"))  # fmt: skip
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            wait_until(lambda past=step + 3: _trained_past(run, past), 120, f"training past step {step + 3}")
            # a checkpoint write takes a few ms here: these land before, inside and after one
            time.sleep(delay)
            proc.send_signal(signal.SIGKILL)
            assert proc.wait(timeout=30) == -signal.SIGKILL
        finally:
            reap([proc])
        latest = latest_checkpoint(run / "checkpoints")
        step = load_checkpoint(latest).step  # loadable, and the next run resumes from it
    assert step > 3


def _trained_past(run: Path, step: int) -> bool:
    path = run / "metrics.jsonl"
    return path.exists() and any(r.get("step", 0) > step for r in read_metrics(path) if "loss" in r)


def _as_background_job():  # what `cmd &` in a shell script does: SIGINT ignored, inherited by the child
    signal.signal(signal.SIGINT, signal.SIG_IGN)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["sigterm", "sigint-background"])
def test_signal_writes_a_checkpoint(config, tmp_path, sig):
    """SIGTERM, and SIGINT even where the peer was started as a background job (Python would leave SIGINT
    ignored), checkpoint and stop with 130."""
    run = tmp_path / "run"
    cmd = peer_cmd(
        *_solo_args(config, run, "--max-steps", "100000", "--set", "train.checkpoint_every=100000")
    )
    proc = subprocess.Popen(
        cmd,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=_as_background_job if sig == signal.SIGINT else None,
        start_new_session=True,  # reap() kills its group
    )
    deadline = time.time() + 60
    while time.time() < deadline and not ((run / "metrics.jsonl").exists() and len(_losses(run)) > 3):
        time.sleep(0.2)
    proc.send_signal(sig)
    try:
        _, err = proc.communicate(timeout=60)
    finally:
        reap([proc])
    assert proc.returncode == 130, err
    assert load_checkpoint(latest_checkpoint(run / "checkpoints")).step >= 3


def test_a_lost_ctrl_c_still_stops_training_at_the_next_step(config, tmp_path):
    """swarm-peer's signal handler sets ``stop`` and raises KeyboardInterrupt; where Python swallowed that
    exception (it landed in an at-fork hook while a group opened), the loop stops at its next step."""
    from swarm.config import load_config
    from swarm.train.sync_hook import NoSync
    from swarm.train.trainer import Trainer

    stop = threading.Event()

    class LostCtrlC(NoSync):
        def after_step(self, model, report):
            if report.step == 3:
                stop.set()  # what the handler does, minus the exception
            return super().after_step(model, report)

    trainer = Trainer(load_config(config), tmp_path / "run", sync=LostCtrlC(), progress=False, stop=stop)
    trainer.setup()
    try:
        with pytest.raises(KeyboardInterrupt):
            trainer.train(max_steps=50)
    finally:
        trainer.close()
    assert load_checkpoint(latest_checkpoint(tmp_path / "run" / "checkpoints")).step == 3
