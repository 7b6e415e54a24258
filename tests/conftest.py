import hashlib
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# Fixtures that several test modules share, kept in files of their own.
pytest_plugins = ["tests.data_fixtures", "tests.trainer_fixtures"]

# A model small enough that a training step takes milliseconds on 2 CPU cores.
TINY_CONFIG = {
    "run_id": "tiny",
    "model": {
        "vocab_size": 512,
        "d_model": 32,
        "n_layers": 2,
        "n_heads": 4,
        "n_experts": 8,
        "expert_hidden": 32,
        "top_k": 2,
        "max_seq_len": 64,
    },
    "experts": {"per_peer": 2},
    "data": {"seq_len": 32, "micro_batch": 4, "val_batches": 2},
    "train": {
        "lr": 3e-3,
        "warmup_steps": 5,
        "decay_steps": 100,
        "max_steps": 100,
        "log_every": 1,
        "eval_every": 10,
        "checkpoint_every": 10,
        "threads": 1,
    },
}


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return ROOT


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory) -> Path:
    """A real prepared dataset: ~60 standard-library modules, byte-level BPE of 512 tokens."""
    from swarm.data import prepare, train_bpe_tokenizer

    root = tmp_path_factory.mktemp("tiny_data")
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(stdlib.glob("[a-m]*.py"))[:60]
    tok = train_bpe_tokenizer(files, 512, root / "tokenizer.json")
    prepare([str(f) for f in files], tok, root / "data", num_workers=1, progress=False)
    return root / "data"


@pytest.fixture
def tiny_config(request, tmp_path, tiny_data) -> Path:
    """Write the tiny config (pointing at ``tiny_data``) and return its path. Each test's run has an id of
    its own: the tests of a session share one bootstrap peer (one DHT), and their records must not mix."""
    run_id = "tiny-" + hashlib.sha256(request.node.nodeid.encode()).hexdigest()[:8]
    cfg = {**TINY_CONFIG, "run_id": run_id, "data": {**TINY_CONFIG["data"], "path": str(tiny_data)}}
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def peer_cmd(*args: str) -> list[str]:
    """The ``swarm-peer`` command line (``python -m peers.main``, so no install is needed)."""
    return [sys.executable, "-m", "peers.main", "--no-progress", *args]


def run_peer(*args: str, env: dict | None = None, timeout: float = 240) -> subprocess.CompletedProcess:
    """``swarm-peer`` as a real process, bounded in time."""
    return subprocess.run(
        peer_cmd(*args),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )


@pytest.fixture(scope="session")
def bootstrap_peer(tmp_path_factory):
    """A real ``swarm-bootstrap`` process on 127.0.0.1, one per session (each test's ``tiny_config`` names a
    run of its own); yields its multiaddr, then stops it (by PID) and checks that it exited cleanly."""
    log = tmp_path_factory.mktemp("bootstrap") / "bootstrap.log"
    with open(log, "w") as fh:
        proc = subprocess.Popen(
            [sys.executable, "-m", "bootstrap.main"], cwd=ROOT, stdout=fh, stderr=subprocess.STDOUT
        )
    try:
        maddr = wait_for_maddr(log, proc)
        yield maddr
    finally:
        proc.terminate()
        try:
            code = proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            code = proc.wait(timeout=10)
    assert code == 0, log.read_text()[-2000:]


def wait_for_maddr(log: Path, proc: subprocess.Popen, timeout: float = 60) -> str:
    """The multiaddr a bootstrap process prints (the demo's own helper), with its log on failure."""
    from peers.demo import wait_for_maddr as demo_wait

    try:
        return demo_wait(log, proc, timeout)
    except (RuntimeError, TimeoutError) as e:
        raise RuntimeError(f"{e}: {log.read_text()[-2000:]}") from None


# Swarm settings for process tests: rounds every 50 steps, short windows and timeouts.
SWARM_SETTINGS = [
    "--set",
    "experts.per_peer=4",
    "--set",
    "sync.sync_every=50",
    "--set",
    "sync.matchmaking_s=3",
    "--set",
    "sync.round_timeout_s=30",
    "--set",
    "sync.heartbeat_s=2",
]


def swarm_peer_args(config: Path, maddr: str, run: Path, *extra: str, max_steps: int = 100000) -> list[str]:
    """``swarm-peer`` arguments for a process test: the config, the swarm, a run dir, SWARM_SETTINGS."""
    args = ["--config", str(config), "--initial-peers", maddr, "--run-dir", str(run)]
    return [*args, "--max-steps", str(max_steps), *SWARM_SETTINGS, *extra]


def round_records(run_dir: Path) -> list:
    """The rounds a peer ran (``RoundRecord``s from its metrics.jsonl; skipped sync points left out)."""
    from swarm.train.metrics_log import read_metrics
    from swarm.train.round_record import RoundRecord

    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        return []
    records = [RoundRecord.from_dict(r) for r in read_metrics(path) if RoundRecord.is_round(r)]
    return [r for r in records if r.started]


def wait_until(cond, timeout: float, what: str, detail=None) -> None:
    """Poll ``cond`` until it holds; past ``timeout`` seconds raise, with ``detail()`` (say, a log's tail)
    appended so that a failure on CI explains itself."""
    import time

    deadline = time.time() + timeout
    while time.time() < deadline:
        if cond():
            return
        time.sleep(0.2)
    raise TimeoutError(what if detail is None else f"{what}\n{detail()}")


def start_peer(args: list[str], log: Path) -> subprocess.Popen:
    """A ``swarm-peer`` process in its own process group (it and its hivemind children can be killed at
    once), stderr appended to ``log``."""
    with open(log, "a") as fh:
        return subprocess.Popen(
            peer_cmd(*args), cwd=ROOT, stdout=subprocess.DEVNULL, stderr=fh, start_new_session=True
        )


def reap(procs) -> int:
    """Kill every process group we started that is still there (by PID), and wait (up to 10 s) until each
    is gone, its other members (DHT, p2pd) included; returns how many were killed."""
    import contextlib
    import signal
    import time

    running = [p for p in procs if p is not None and p.poll() is None]
    for p in running:  # a test that failed may have left a peer waiting: its stacks go to its log first
        with contextlib.suppress(ProcessLookupError):
            os.kill(p.pid, signal.SIGUSR1)
    if running:
        time.sleep(0.5)
    for p in running:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)
        p.wait(timeout=30)
    end = time.monotonic() + 10  # the leader is gone at once, its children a moment later
    for p in running:
        while time.monotonic() < end:
            try:
                os.killpg(p.pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.05)
    return len(running)


# The swarms of real processes: `make test` runs them one at a time, after the rest of the suite (which runs
# on four workers, one module per worker at a time), because their timing assumes that no other swarm and no
# heavy test shares the 2 cores. `pytest -m swarm` selects them, `-m "not swarm"` the rest.
SWARMS = {
    "test_swarm.py",
    "test_swarm_membership.py",
    "test_local_ranks.py::test_two_rank_peer_in_a_swarm",
    "test_dashboard.py::test_live_swarm_in_a_browser",
    "test_gpu.py::test_two_peer_swarm_on_cuda_applies_rounds_and_agrees",
}


def pytest_collection_modifyitems(items) -> None:
    for item in items:
        name = Path(item.fspath).name
        if name in SWARMS or f"{name}::{item.originalname}" in SWARMS:
            item.add_marker(pytest.mark.swarm)
