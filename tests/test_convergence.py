"""benchmarks/convergence.py and convergence_runs.py: every row of a tiny run trained, judged, printed and
saved; repeats interleaved and summarized; the in-process rows' replica averaging exact."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.process_table import alive, processes

ROOT = Path(__file__).resolve().parents[1]


def test_convergence_summary_gives_each_rows_spread_and_its_distance_from_the_swarm():
    from benchmarks.convergence import parse_row_sets, summarize, welch_t
    from benchmarks.convergence_runs import RunResult

    def runs(name, losses, mb):
        return [RunResult(name, loss, 1000, 1.0, bytes_per_peer=mb * 1e6) for loss in losses]

    got = summarize({"central": runs("central", [6.0], 0), "swarm": runs("swarm", [6.4, 6.5, 6.6], 40),
                     "diloco_tokens": runs("diloco_tokens", [6.5, 6.7], 44)})  # fmt: skip
    assert [s["summary"] for s in got] == ["swarm", "diloco_tokens"]  # a row run once has no spread
    swarm, diloco = got
    assert swarm["runs"] == 3 and math.isclose(swarm["val_loss_mean"], 6.5)
    assert math.isclose(swarm["val_loss_sd"], 0.1) and (swarm["val_loss_min"], swarm["val_loss_max"]) == (
        6.4,
        6.6,
    )
    assert "welch_t" not in swarm and math.isclose(diloco["bytes_per_peer_mean"], 44e6)
    assert math.isclose(diloco["vs_swarm_pct"], 100 * (6.6 / 6.5 - 1))
    # Welch: (6.6 - 6.5) / sqrt(0.02 / 2 + 0.01 / 3)
    assert math.isclose(diloco["welch_t"], 0.1 / math.sqrt(0.01 + 0.01 / 3))
    assert welch_t([1.0, 1.0], [1.0, 1.0]) != welch_t([1.0, 1.0], [1.0, 1.0])  # nan: nothing to compare
    assert welch_t([2.0, 2.0], [1.0, 1.0]) == math.inf
    assert parse_row_sets(["diloco_tokens:sync.sync_every_s=40", "diloco_tokens:train.lr=1e-3"]) == {
        "diloco_tokens": ["sync.sync_every_s=40", "train.lr=1e-3"]
    }
    for bad in ("central:train.lr=1", "every_step:train.lr=1", "swarm", "swarm:train.lr", "nope:a=1"):
        with pytest.raises(ValueError, match="--row-set"):
            parse_row_sets([bad])


def test_convergence_benchmark_repeats_its_swarm_rows_interleaved(tiny_data, tmp_path, capsys):
    """--repeat 2: central once, the swarm rows twice in turn (each in its own directory, a --row-set applied
    to its row only), then one summary per repeated row whose mean is that of the printed runs."""
    import yaml

    from benchmarks.convergence import main
    from tests.conftest import TINY_CONFIG

    cfg = {**TINY_CONFIG, "data": {**TINY_CONFIG["data"], "path": str(tiny_data)},
           "sync": {"sync_every": 4, "matchmaking_s": 0.3, "round_timeout_s": 5.0, "heartbeat_s": 0.3,
                    "download_timeout_s": 2.0, "merge_warmup_steps": 8, "merge_every": 1}}  # fmt: skip
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(cfg))
    out, keep = tmp_path / "out", tmp_path / "keep"
    # in process (the subprocess of the every-row test above already covers the script's own start)
    code = main(["--config", str(path), "--corpus", str(tiny_data), "--transport", "local", "--steps", "4",
                 "--peers", "2", "--json", "--out", str(out), "--keep", str(keep), "--rows", "central", "swarm",
                 "diloco_tokens", "--repeat", "2", "--row-set", "diloco_tokens:sync.sync_every=2"])  # fmt: skip
    assert code == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    rows = [r for r in lines if "row" in r]
    assert [(r["row"], r["repeat"]) for r in rows] == [
        ("central", 0),
        ("swarm", 0),
        ("diloco_tokens", 0),
        ("swarm", 1),
        ("diloco_tokens", 1),
    ]
    assert [r["row_set"] for r in rows] == [[], [], ["sync.sync_every=2"], [], ["sync.sync_every=2"]]
    assert all(
        (keep / d / "peer0").is_dir() for d in ("swarm", "swarm-2", "diloco_tokens", "diloco_tokens-2")
    )
    summaries = {s["summary"]: s for s in lines if "summary" in s}
    assert set(summaries) == {"swarm", "diloco_tokens"}
    for name, s in summaries.items():
        losses = [r["val_loss"] for r in rows if r["row"] == name]
        assert s["runs"] == 2 and math.isclose(s["val_loss_mean"], sum(losses) / 2), (s, losses)
    assert "vs_swarm_pct" in summaries["diloco_tokens"] and "vs_swarm_pct" not in summaries["swarm"]
    saved = json.loads((out / "convergence.json").read_text())
    assert {k: len(v) for k, v in saved["runs"].items()} == {"central": 1, "swarm": 2, "diloco_tokens": 2}
    assert saved["summary"] == list(summaries.values())


def test_convergence_benchmark_produces_every_row(tiny_data, tmp_path):
    """benchmarks/convergence.py at a tiny shape, its swarms as threads on the in-memory transport: every
    row is trained, judged by the one evaluator, printed, plotted and saved."""
    import yaml

    from benchmarks.convergence import EXTRA_ROWS, ROWS
    from tests.conftest import TINY_CONFIG

    cfg = {**TINY_CONFIG, "data": {**TINY_CONFIG["data"], "path": str(tiny_data)},
           "sync": {"sync_every": 4, "matchmaking_s": 0.3, "round_timeout_s": 5.0, "heartbeat_s": 0.3,
                    "download_timeout_s": 2.0, "merge_warmup_steps": 8, "merge_every": 1}}  # fmt: skip
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(cfg))
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "convergence.py"), "--config", str(path), "--corpus",
         str(tiny_data), "--transport", "local", "--steps", "12", "--peers", "2", "--json", "--out", str(out),
         "--rows", *ROWS, *EXTRA_ROWS, "--average-every", "2", "--average-experts-every", "4"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    split = [f"{r}_every_2_experts_every_4" for r in EXTRA_ROWS]  # dense weights every 2 steps, experts 4
    assert [r["row"] for r in rows] == [*ROWS, *split]
    central = rows[0]
    assert central["ratio_to_central"] == 1.0 and central["bytes_per_peer"] == 0
    for r in rows:
        assert math.isfinite(r["val_loss"]) and 0 < r["val_loss"] < 8.0, r  # below ln(512) = 6.24 + margin
        assert r["tokens"] == 12 * 2 * cfg["data"]["micro_batch"] * cfg["data"]["seq_len"], r
    swarms = {r["row"]: r for r in rows if r["row"] not in ("central", *split)}
    assert all(r["bytes_per_peer"] > 0 and r["rounds_applied"] >= 1 for r in swarms.values()), swarms
    saved = json.loads((out / "convergence.json").read_text())
    assert set(saved["rows"]) == {*ROWS, *EXTRA_ROWS} and all(
        saved["rows"][k]["curve"] for k in saved["rows"]
    )
    assert (out / "convergence.png").stat().st_size > 10_000


def test_averaged_replicas_take_the_dense_mean_and_each_expert_from_its_trainers():
    """convergence_runs' in-process averaging (the every_step rows): dense weights are the mean of every
    replica, an expert the mean of the replicas that train it, an expert nobody trains stays; all agree."""
    import torch

    from benchmarks.replica_rounds import average_replicas
    from swarm.config import ModelConfig
    from swarm.model import MoETransformer
    from tests.conftest import TINY_CONFIG

    mcfg = ModelConfig(**TINY_CONFIG["model"])
    owned = [[0, 1], [1, 2], [3]]  # expert 1 has two trainers; 4-7 have none
    models = []
    for i, own in enumerate(owned):
        m = MoETransformer(mcfg, own)
        m.init_weights(seed=i)  # every replica different
        models.append(m)
    before = [m.canonical_state_dict() for m in models]
    average_replicas(models, owned, mcfg.n_experts)
    after = [m.canonical_state_dict() for m in models]
    for name, value in after[0].items():
        assert all(torch.equal(value, a[name]) for a in after[1:]), name  # every replica alike
        if ".experts." not in name:
            assert torch.allclose(value, sum(b[name] for b in before) / 3, atol=1e-7), name
            continue
        assert torch.equal(value[0], before[0][name][0]) and torch.equal(value[3], before[2][name][3])
        assert torch.allclose(value[1], (before[0][name][1] + before[1][name][1]) / 2, atol=1e-7)
        assert torch.equal(value[2], before[1][name][2]) and torch.equal(value[5], before[0][name][5])


def _two_replicas():
    """Two tiny replicas, each training half of the 8 experts, initialised differently."""
    from swarm.config import ModelConfig
    from swarm.model import MoETransformer
    from tests.conftest import TINY_CONFIG

    mcfg = ModelConfig(**TINY_CONFIG["model"])
    owned = [[0, 1, 2, 3], [4, 5, 6, 7]]
    models = []
    for i, own in enumerate(owned):
        m = MoETransformer(mcfg, own)
        m.init_weights(seed=i)
        models.append(m)
    return mcfg, owned, models


def test_replicas_average_dense_weights_and_experts_on_intervals_of_their_own():
    """``--average-experts-every``: a dense-only average leaves every replica's experts, copies included, as
    they were; an experts-only one refreshes the copies from their trainers and leaves the dense weights."""
    import torch

    from benchmarks.replica_rounds import average_replicas

    mcfg, owned, models = _two_replicas()
    before = [m.canonical_state_dict() for m in models]
    average_replicas(models, owned, mcfg.n_experts, experts=False)
    dense_only = [m.canonical_state_dict() for m in models]
    average_replicas(models, owned, mcfg.n_experts, dense=False)
    experts_only = [m.canonical_state_dict() for m in models]
    for name in before[0]:
        if ".experts." not in name:
            mean = (before[0][name] + before[1][name]) / 2
            assert all(torch.allclose(d[name], mean, atol=1e-7) for d in dense_only), name
            assert all(
                torch.equal(e[name], d[name]) for e, d in zip(experts_only, dense_only, strict=True)
            ), name
            continue
        assert all(torch.equal(d[name], b[name]) for d, b in zip(dense_only, before, strict=True)), name
        for e in range(mcfg.n_experts):
            trainer = before[e // 4][name][e]
            assert all(torch.equal(x[name][e], trainer) for x in experts_only), (name, e)
    assert not torch.equal(before[0]["embed.weight"], before[1]["embed.weight"])


def test_late_averages_land_on_the_steps_taken_meanwhile():
    """``--average-delay``: an average lands ``delay`` steps after its snapshots, each replica taking the
    mean of the snapshots plus its own change since; nothing lands early, and everything at the last."""
    import torch

    from benchmarks.replica_rounds import LateAverages

    mcfg, owned, models = _two_replicas()
    snaps = [m.canonical_state_dict() for m in models]  # copies
    late = LateAverages(owned, mcfg.n_experts, delay=2)
    late.start(models, step=10, experts=False)

    def train_on(k: int, by: float) -> None:  # a step of replica k: its dense embedding moves
        state = models[k].canonical_state_dict()
        state["embed.weight"] = state["embed.weight"] + by
        models[k].load_canonical_state_dict(state)

    train_on(0, 1.0)
    late.land(models, step=11)  # not yet: begun at 10, lands at 12
    assert torch.equal(models[0].canonical_state_dict()["embed.weight"], snaps[0]["embed.weight"] + 1.0)
    late.start(models, step=11, dense=False)  # an experts' round, in flight at the end
    late.land(models, step=12)
    mean = (snaps[0]["embed.weight"] + snaps[1]["embed.weight"]) / 2
    after = [m.canonical_state_dict() for m in models]
    assert torch.allclose(after[0]["embed.weight"], mean + 1.0, atol=1e-6)
    assert torch.allclose(after[1]["embed.weight"], mean, atol=1e-6)
    experts = [k for k in after[0] if ".experts." in k]
    assert all(torch.equal(after[1][k][0], snaps[1][k][0]) for k in experts)  # its copy of 0 not yet fresh
    late.land(models, step=12, everything=True)
    after = [m.canonical_state_dict() for m in models]
    assert all(torch.allclose(after[1][k][0], snaps[0][k][0], atol=1e-6) for k in experts)  # its trainer's
    assert not any(torch.allclose(snaps[1][k][0], snaps[0][k][0], atol=1e-3) for k in experts)
    with pytest.raises(ValueError, match="delay"):
        LateAverages(owned, mcfg.n_experts, delay=-1)


def test_outer_averaging_steps_each_replica_as_a_peer_applies_a_round():
    """The every_step rows' outer step (``--average-outer``): alpha 1 without momentum is plain averaging;
    a first round at alpha 0.5 moves each replica's dense weights half-way to the mean, an expert with one
    trainer does not move (its mean is itself), and a copy of an expert is its trainer's."""
    import torch

    from benchmarks.outer_average import OuterAverage
    from benchmarks.replica_rounds import average_replicas
    from swarm.config import ModelConfig
    from swarm.model import MoETransformer
    from tests.conftest import TINY_CONFIG

    mcfg = ModelConfig(**TINY_CONFIG["model"])
    owned = [[0, 1], [1, 2], [3]]

    def replicas():
        out = []
        for i, own in enumerate(owned):
            m = MoETransformer(mcfg, own)
            m.init_weights(seed=i)
            out.append(m)
        return out

    plain, outer = replicas(), replicas()
    before = [m.canonical_state_dict() for m in plain]
    average_replicas(plain, owned, mcfg.n_experts)
    OuterAverage(owned, mcfg.n_experts, alpha=1.0, momentum=0.0)(outer)
    for p, o in zip(plain, outer, strict=True):
        for name, value in p.canonical_state_dict().items():
            assert torch.allclose(value, o.canonical_state_dict()[name], atol=1e-6), name

    half = replicas()
    OuterAverage(owned, mcfg.n_experts, alpha=0.5, momentum=0.9)(half)
    after = [m.canonical_state_dict() for m in half]
    for name in after[0]:
        if ".experts." not in name:
            mean = sum(b[name] for b in before) / 3
            for b, a in zip(before, after, strict=True):  # momentum's first step: g + 0.9 g
                assert torch.allclose(a[name], b[name] + 0.5 * 1.9 * (mean - b[name]), atol=1e-5), name
            continue
        for a in after:
            assert torch.equal(a[name][0], before[0][name][0]) and torch.equal(a[name][3], before[2][name][3])
            assert torch.equal(a[name][2], before[1][name][2])
        both = (before[0][name][1] + before[1][name][1]) / 2  # expert 1: two trainers
        assert torch.allclose(
            after[1][name][1], before[1][name][1] + 0.95 * (both - before[1][name][1]), atol=1e-5
        )
        assert torch.equal(after[2][name][1], after[0][name][1])  # a copy: the first trainer's


def test_merged_replicas_take_the_warm_up_step_on_every_expert():
    """The every_step rows' merge warm-up (``--average-merge``): every expert of every replica moves as
    ``merge_experts`` moves it, judged on that replica's own copies; the dense weights stay."""
    import torch

    from benchmarks.replica_rounds import merge_replicas
    from swarm.config import ModelConfig
    from swarm.model import MoETransformer
    from swarm.sync import merge_experts
    from tests.conftest import TINY_CONFIG

    mcfg = ModelConfig(**TINY_CONFIG["model"])
    models = []
    for i, own in enumerate([[0, 1], [2]]):
        m = MoETransformer(mcfg, own)
        m.init_weights(seed=i)
        models.append(m)
    before = [m.canonical_state_dict() for m in models]
    merge_replicas(models, alpha=0.3, topk=2)
    for b, m in zip(before, models, strict=True):
        after = m.canonical_state_dict()
        for name in b:
            if not name.endswith(".experts.gate_up"):
                if ".experts." not in name:
                    assert torch.equal(after[name], b[name]), name
                continue
            down = name.replace("gate_up", "down")
            gu, dn = merge_experts(b[name], b[down], list(range(mcfg.n_experts)), 0.3, 2)
            assert not torch.allclose(gu, b[name])  # it moved
            assert torch.allclose(after[name], gu, atol=1e-6) and torch.allclose(after[down], dn, atol=1e-6)


def test_merged_replicas_with_owners_move_only_their_own_experts():
    """With ``owned`` (split intervals): a replica merges its own experts, judged on all its copies, and
    leaves its copies of the others' as they were, for the next average of the experts to refresh."""
    import torch

    from benchmarks.replica_rounds import merge_replicas
    from swarm.sync import merge_experts

    mcfg, owned, models = _two_replicas()
    before = [m.canonical_state_dict() for m in models]
    merge_replicas(models, alpha=0.3, topk=2, owned=owned)
    for own, b, m in zip(owned, before, models, strict=True):
        after = m.canonical_state_dict()
        for name in [n for n in b if n.endswith(".experts.gate_up")]:
            down = name.replace("gate_up", "down")
            gu, dn = merge_experts(b[name], b[down], own, 0.3, 2)
            assert torch.allclose(after[name][own], gu, atol=1e-6) and torch.allclose(
                after[down][own], dn, atol=1e-6
            )
            assert not torch.allclose(after[name][own], b[name][own])  # it moved
            others = [e for e in range(mcfg.n_experts) if e not in own]
            assert torch.equal(after[name][others], b[name][others]) and torch.equal(
                after[down][others], b[down][others]
            )


@pytest.mark.parametrize(
    "flags",
    [
        ["--average-experts-every", "4", "--average-outer", "0.7,0.9"],
        ["--average-delay", "2", "--average-merge"],
        ["--average-outer", "0.7,0.9", "--average-codec", "int8"],
        ["--average-delay", "2", "--average-codec", "int8"],
        ["--average-delay", "2", "--average-dense-codec", "int4"],
        ["--average-delay", "-1"],
        ["--average-embeddings-every", "4", "--average-codec", "int8"],
        ["--average-embeddings-every", "4", "--average-delay", "1"],
        ["--average-embeddings-every", "-1"],
        ["--average-early", "2,0"],
        ["--average-early", "2"],
        ["--average-early", "1,40", "--average-embeddings-every", "4"],
    ],
)
def test_convergence_refuses_in_process_settings_it_does_not_model(flags, capsys):
    """Split intervals take no outer step, late averages plain averaging only: anything else is a usage
    error (rc 2) before any corpus is prepared."""
    from benchmarks.convergence import main

    with pytest.raises(SystemExit) as stop:
        main(["--rows", "every_step_spes", "--average-every", "2", *flags])
    assert stop.value.code == 2 and "--average-" in capsys.readouterr().err


def test_replicas_average_the_embeddings_apart_from_the_other_dense_weights(tiny_config):
    """``--average-embeddings-every``: an average without the embeddings leaves each replica's token
    embeddings and output head as they were and averages attention, norms and routers; a run with them
    on an interval of their own trains, is judged and says so in its name."""
    import torch

    from benchmarks.every_step_runs import run_every_step
    from benchmarks.replica_rounds import EMBEDDINGS, average_replicas
    from swarm.config import load_config

    mcfg, owned, models = _two_replicas()
    before = [m.canonical_state_dict() for m in models]
    average_replicas(models, owned, mcfg.n_experts, experts=False, embeddings=False)
    after = [m.canonical_state_dict() for m in models]
    assert EMBEDDINGS <= before[0].keys()
    for name in before[0]:
        if name in EMBEDDINGS or ".experts." in name:
            assert all(torch.equal(a[name], b[name]) for a, b in zip(after, before, strict=True)), name
        else:
            mean = (before[0][name] + before[1][name]) / 2
            assert all(torch.allclose(a[name], mean, atol=1e-7) for a in after), name
    assert not torch.equal(after[0]["embed.weight"], after[1]["embed.weight"])

    cfg = load_config(tiny_config)
    res = run_every_step(cfg, 4, peers=2, eval_every=4, every=1, own_experts=True, embeddings_every=2)
    assert res.name == "every_step_spes_embeddings_every_2"
    assert math.isfinite(res.val_loss) and 0 < res.val_loss < 8.0, res


def test_an_early_schedule_averages_the_dense_weights_more_often_up_to_its_step(tiny_config):
    """``--average-early EVERY,UNTIL``: dense averages every step up to the last step are the row with the
    dense weights averaged every step, to the last digit; a schedule that ends earlier takes a path of its
    own, neither that row's nor the plain interval's."""
    from benchmarks.every_step_runs import run_every_step
    from swarm.config import load_config

    cfg = load_config(tiny_config)
    runs = {
        early: run_every_step(cfg, 4, peers=2, eval_every=4, every=4, own_experts=True, early=early)
        for early in [(0, 0), (1, 4), (1, 2)]
    }
    every_step = run_every_step(cfg, 4, peers=2, eval_every=4, every=1, own_experts=True, experts_every=4)
    assert runs[(1, 4)].name == "every_step_spes_every_4_early_1_until_4"
    assert runs[(1, 4)].val_loss == every_step.val_loss
    assert len({r.val_loss for r in runs.values()}) == 3


def test_split_intervals_run_through_a_codec_and_merges(tiny_config):
    """run_every_step with split intervals, the int8 codec (dense int4) and merges trains and is judged; the
    codec and the merges change its path from the plain split row's."""
    from benchmarks.every_step_runs import run_every_step
    from swarm.config import load_config

    cfg = load_config(tiny_config, ["sync.merge_warmup_steps=8", "sync.merge_every=1"])
    coded = {"codec": "int8", "dense_codec": "int4", "merge": True}
    runs = {
        kind: run_every_step(cfg, 6, peers=2, eval_every=6, every=2, own_experts=True, experts_every=4, **kw)
        for kind, kw in {"plain": {}, "coded": coded}.items()
    }
    assert runs["plain"].name == "every_step_spes_every_2_experts_every_4"
    assert runs["coded"].name == "every_step_spes_every_2_experts_every_4_int8_dense_int4_merge_0.5"
    for res in runs.values():
        assert math.isfinite(res.val_loss) and 0 < res.val_loss < 8.0, res
    assert runs["coded"].val_loss != runs["plain"].val_loss


@pytest.mark.swarm
def test_sigterm_stops_the_benchmark_and_the_swarm_it_started(tiny_config, tiny_data, tmp_path):
    """A swarm row's bootstrap and peers run in sessions of their own: SIGTERM to the benchmark stops them
    too (as Ctrl+C does), and it exits 130 within the peers' own shutdown bound."""
    import signal
    import time

    keep, started = tmp_path / "runs", []
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "benchmarks" / "convergence.py"), "--config", str(tiny_config),
         "--corpus", str(tiny_data), "--rows", "swarm", "--steps", "5000", "--peers", "2",
         "--keep", str(keep), "--json"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and len(started) < 3:  # the bootstrap and both peers
            time.sleep(0.5)
            if (keep / "swarm" / "peer1.log").exists():
                started = [pid for pid, (ppid, _) in processes().items() if ppid == proc.pid]
        assert len(started) == 3, (started, proc.poll())
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=90)
        assert proc.returncode == 130 and "interrupted" in err, err[-2000:]
        assert not [pid for pid in started if alive(pid)], started
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for pid in started:  # on a failure: each child leads a session of its own (its p2pd with it)
            if alive(pid):
                os.killpg(pid, signal.SIGKILL)
