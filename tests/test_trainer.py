"""The local trainer through ``swarm-peer``: learning, exact resume, kills during checkpoint writes.

The runs that the learning, resume and kill tests check are made once per module, side by side (each
process spends most of its time starting up; on 2 cores two at a time take about as long as one): the
reference, one uninterrupted 60-step run (every resumed run must reproduce its losses: the schedule does
not depend on ``--max-steps``, so its first N steps are those of an uninterrupted N-step run), a run
stopped at step 20, and the four runs SIGKILLed inside a checkpoint write; then, side by side again, each
interrupted run resumed. Refusals that happen before any training run in this process; one still runs as a
real process, so that the exit code and the single stderr line of the real command stay checked."""

import json
import os
import shutil
import signal
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from swarm.train import load_checkpoint
from swarm.train.checkpoint import latest_checkpoint, list_checkpoints
from swarm.train.metrics_log import read_metrics
from tests.conftest import ROOT, peer_cmd, reap, run_peer
from tests.hf_helpers import peer_here
from tests.trainer_fixtures import _losses, _solo_args

KILL_POINTS = ["model_written", "optimizer_written", "before_rename", "before_prune"]


def _solo(config, run_dir, *args: str):
    return run_peer(*_solo_args(config, run_dir, *args))


def _side_by_side(jobs: dict[str, tuple[list[str], dict]]) -> dict[str, subprocess.CompletedProcess]:
    """``swarm-peer ARGS`` with extra environment variables, for every job at once; ``{name: result}``."""
    procs = {}
    try:
        for name, (args, env) in jobs.items():
            procs[name] = subprocess.Popen(
                peer_cmd(*args),
                cwd=ROOT,
                env={**os.environ, **env},
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                start_new_session=True,  # reap() kills its process group
            )
        results = {}
        for name, proc in procs.items():
            out, err = proc.communicate(timeout=240)
            results[name] = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
        return results
    finally:
        reap(procs.values())


def _latest_step(run_dir: Path):
    """The step of the latest checkpoint, or what loading it raised."""
    try:
        return load_checkpoint(latest_checkpoint(run_dir / "checkpoints")).step
    except Exception as e:
        return e


@dataclass
class Run:
    dir: Path
    first: subprocess.CompletedProcess
    latest_step: object = None  # the latest checkpoint's step once `first` ended (or what loading it raised)
    resumed: subprocess.CompletedProcess | None = None


@pytest.fixture(scope="module")
def runs(config, tmp_path_factory) -> dict[str, Run]:
    """``{"reference": 60 steps, "part": 20 steps, then resumed to 40, POINT: 50 steps SIGKILLed at POINT of
    writing checkpoint 30, then resumed to 50}``."""
    root = tmp_path_factory.mktemp("runs")
    dirs = {name: root / name for name in ["reference", "part", *KILL_POINTS]}
    first = _side_by_side(
        {
            "reference": (_solo_args(config, dirs["reference"], "--max-steps", "60"), {}),
            "part": (_solo_args(config, dirs["part"], "--max-steps", "20"), {}),
            **{
                point: (
                    _solo_args(config, dirs[point], "--max-steps", "50"),
                    {"SWARM_FAULT_KILL_AT": f"{point}@30"},
                )
                for point in KILL_POINTS
            },
        }
    )
    out = {name: Run(path, first[name], _latest_step(path)) for name, path in dirs.items()}
    resumed = _side_by_side(
        {
            "part": (_solo_args(config, dirs["part"], "--max-steps", "40", "--resume"), {}),
            **{
                point: (_solo_args(config, dirs[point], "--max-steps", "50", "--resume"), {})
                for point in KILL_POINTS
            },
        }
    )
    for name, res in resumed.items():
        out[name].resumed = res
    return out


@pytest.fixture
def reference(runs) -> Path:
    """The uninterrupted 60-step run's directory (read only: copy it to change it)."""
    ref = runs["reference"].first
    assert ref.returncode == 0, ref.stderr[-3000:]
    return runs["reference"].dir


def test_solo_peer_learns_and_writes_metrics(runs, reference):
    summary = json.loads(runs["reference"].first.stdout.strip().splitlines()[-1])
    assert summary["final_val_loss"] < 0.93 * summary["initial_val_loss"]
    records = read_metrics(reference / "metrics.jsonl")
    train = [r for r in records if "loss" in r]
    assert [r["step"] for r in train] == list(range(1, 61))
    for key in ("step", "tokens", "loss", "lr", "tokens_per_s"):
        assert key in train[-1]
    assert train[-1]["tokens"] == 60 * 4 * 32
    assert sum("val_loss" in r for r in records) == 1 + 6  # step 0 and every 10 steps
    assert (reference / "config.yaml").exists()
    ckpt = load_checkpoint(latest_checkpoint(reference / "checkpoints"))
    assert ckpt.step == 60 and ckpt.state["local_experts"] == [0, 1]
    assert len(list_checkpoints(reference / "checkpoints")) == 3  # keep_checkpoints


def test_resume_reproduces_uninterrupted_run(runs, reference):
    part = runs["part"]
    assert part.first.returncode == 0, part.first.stderr[-3000:]
    assert part.resumed.returncode == 0, part.resumed.stderr
    a, b = _losses(reference), _losses(part.dir)
    assert sorted(b) == list(range(1, 41))
    assert max(abs(a[s] - b[s]) for s in range(21, 41)) <= 1e-5


@pytest.mark.parametrize("point", KILL_POINTS)
def test_kill_during_checkpoint_write_leaves_loadable_latest(runs, reference, point):
    """SIGKILL at each point of writing checkpoint 30; the latest checkpoint still loads, and --resume
    reproduces an uninterrupted run over the next 20 steps."""
    run = runs[point]
    assert run.first.returncode == -signal.SIGKILL, run.first.stderr[-3000:]
    # loading the visible latest never raises: it is always complete
    assert run.latest_step == (30 if point == "before_prune" else 20)
    assert run.resumed.returncode == 0, run.resumed.stderr
    a, b = _losses(reference), _losses(run.dir)
    start = run.latest_step + 1
    assert max(abs(a[s] - b[s]) for s in range(start, start + 20)) <= 1e-5
    assert not list((run.dir / "checkpoints").glob(".tmp-*")), "stale temporaries were not cleaned"


def _one_error_line(res):
    lines = [ln for ln in res.stderr.strip().splitlines() if ln.strip()]
    assert res.returncode == 2, res.stderr
    assert len(lines) == 1 and lines[0].startswith("error: "), res.stderr
    return lines[0]


@pytest.fixture
def refused(capsys, monkeypatch):
    """``refused(*ARGS)``: ``swarm-peer ARGS`` in this process (it refuses before training) gives exit code 2
    and one stderr line, ``error: ...``; returns that line."""

    def run(*args: str) -> str:
        code, _, err = peer_here(capsys, monkeypatch, *args)
        lines = [ln for ln in err.strip().splitlines() if ln.strip()]
        assert code == 2 and len(lines) == 1 and lines[0].startswith("error: "), (code, err)
        return lines[0]

    return run


def test_bad_config_values_exit_2(config, tmp_path, refused):
    assert "train.lr" in refused("--config", str(config), "--solo", "--set", "train.lr=-1")
    assert "model.n_headz" in refused("--config", str(config), "--solo", "--set", "model.n_headz=3")
    assert "model.d_model" in refused("--config", str(config), "--solo", "--set", "model.d_model=abc")
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [1, 2\n")
    assert "not valid YAML" in refused("--config", str(bad), "--solo")
    assert "not found" in refused("--config", str(tmp_path / "nope.yaml"), "--solo")


def test_missing_tokenizer_exit_2(config, tmp_path, refused):
    run = ["--config", str(config), "--solo", "--run-dir", str(tmp_path / "r")]
    line = refused(*run, "--set", f"data.tokenizer={tmp_path / 'missing.json'}")
    assert "missing.json" in line


def test_corrupt_shard_exit_2(config, tiny_data, tmp_path, refused):
    data = tmp_path / "data"
    shutil.copytree(tiny_data, data)
    shard = sorted(data.glob("train_*.npy"))[0]
    with open(shard, "r+b") as fh:  # truncate the shard to half its size
        fh.truncate(os.path.getsize(shard) // 2)
    run = ["--config", str(config), "--solo", "--run-dir", str(tmp_path / "r")]
    assert shard.name in refused(*run, "--set", f"data.path={data}")


def test_corrupt_checkpoint_exit_2_and_is_kept(config, reference, tmp_path):
    """As a real process: exit code 2 and nothing on stderr but the error line."""
    run = tmp_path / "run"
    shutil.copytree(reference, run)
    latest = latest_checkpoint(run / "checkpoints")
    (latest / "model.safetensors").write_bytes(b"garbage")
    line = _one_error_line(_solo(config, run, "--resume"))
    assert "corrupt" in line and latest.name in line
    assert (latest / "model.safetensors").exists()  # nothing already saved is deleted


def test_other_model_in_run_dir_is_refused(config, reference, tmp_path, refused):
    run = tmp_path / "run"
    shutil.copytree(reference, run)
    line = refused("--config", str(config), "--solo", "--run-dir", str(run), "--set", "model.d_model=64")
    assert "different model config" in line


def test_existing_checkpoints_need_resume(config, reference, tmp_path, refused):
    run = tmp_path / "run"
    shutil.copytree(reference, run)
    before = read_metrics(run / "metrics.jsonl")
    assert "--resume" in refused("--config", str(config), "--solo", "--run-dir", str(run))
    assert read_metrics(run / "metrics.jsonl") == before  # nothing saved was touched


def test_megablocks_backend_on_cpu_exit_2(config, tmp_path, refused):
    run = ["--config", str(config), "--solo", "--run-dir", str(tmp_path / "r")]
    line = refused(*run, "--set", "model.moe_backend=megablocks")
    assert "megablocks" in line and "CUDA" in line


def test_checkpoints_are_also_written_on_the_wall_clock(config, tmp_path):
    """``train.checkpoint_every_s``: a peer killed between two step checkpoints loses seconds, not steps."""
    from swarm.config import load_config
    from swarm.train.sync_hook import NoSync
    from swarm.train.trainer import Trainer

    class SlowSteps(NoSync):
        def after_step(self, model, report):
            time.sleep(0.1)  # with the checkpoint's own time, a checkpoint every other step or so
            return super().after_step(model, report)

    cfg = load_config(config, ["train.checkpoint_every=1000", "train.checkpoint_every_s=0.15",
                               "train.keep_checkpoints=100", "train.eval_every=1000"])  # fmt: skip
    trainer = Trainer(cfg, tmp_path / "run", sync=SlowSteps(), progress=False)
    trainer.setup()
    try:
        trainer.train(max_steps=8)
    finally:
        trainer.close()
    steps = [load_checkpoint(p).step for p in list_checkpoints(tmp_path / "run" / "checkpoints")]
    assert 3 <= len(steps) <= 8 and steps[-1] == 8 and all(s < 8 for s in steps[:-1]), steps
    assert all(b - a <= 2 for a, b in zip(steps, steps[1:], strict=False)), steps


def test_a_set_up_failing_after_the_model_is_built_closes_and_shows_its_own_error(
    config, tmp_path, monkeypatch
):
    """A failure injected in ``model.compile()`` (a CUDA peer died there of an import deadlock): ``close()``
    in the caller's ``finally`` ends cleanly, so the set-up's own error is what the user sees."""
    from swarm.config import load_config
    from swarm.model import MoETransformer
    from swarm.train.trainer import Trainer

    def failing_compile(self, *args, **kwargs):
        raise ImportError("injected at compile")

    monkeypatch.setattr(MoETransformer, "compile", failing_compile)
    trainer = Trainer(load_config(config, ["train.compile=true"]), tmp_path / "run", progress=False)
    with pytest.raises(ImportError, match="injected at compile"):
        try:
            trainer.setup()
        finally:
            trainer.close()
    assert trainer.model is not None  # it failed after the model was built
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_min_step_s_paces_the_steps_and_a_stop_request_ends_the_wait(config, tmp_path):
    """``train.min_step_s``: each step but the last lasts at least that long (the rest slept); Ctrl+C does
    not wait for the pause to end."""
    from swarm.config import load_config
    from swarm.train.sync_hook import NoSync
    from swarm.train.trainer import Trainer

    stop, began = threading.Event(), []

    class Clock(NoSync):
        def after_step(self, model, report):
            if report.step == 5:  # the second run's first step
                threading.Timer(0.2, stop.set).start()  # mid-pause: the 30 s pause must not be waited out
            return super().after_step(model, report)

    cfg = load_config(
        config, ["train.min_step_s=0.3", "train.eval_every=1000", "train.checkpoint_every=1000"]
    )
    trainer = Trainer(cfg, tmp_path / "run", sync=Clock(), progress=False, stop=stop)
    trainer.setup()
    step = trainer.train_step
    trainer.train_step = lambda: began.append(time.monotonic()) or step()
    try:
        trainer.train(max_steps=4)
        gaps = [b - a for a, b in zip(began, began[1:], strict=False)]
        assert len(gaps) == 3 and min(gaps) >= 0.3, gaps
        trainer.cfg.train.min_step_s = 30.0
        t0 = time.monotonic()
        with pytest.raises(KeyboardInterrupt):
            trainer.train(max_steps=50)
        assert time.monotonic() - t0 < 20.0 and trainer.step == 5
    finally:
        trainer.close()
    with pytest.raises(Exception, match="train.min_step_s"):
        load_config(config, ["train.min_step_s=-1"])
