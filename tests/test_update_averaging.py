"""benchmarks/update_averaging.py: every mode trained and judged; data-parallel training differs from the
every_step row only in what is averaged; averaged AdamW moments are exact means."""

from __future__ import annotations

import json
import math

import pytest
import torch
import yaml

from tests.conftest import TINY_CONFIG


def _tiny_replicas(n: int):
    from swarm.config import ModelConfig, TrainConfig
    from swarm.model import MoETransformer
    from swarm.train.optimizer import build_optimizer

    mcfg, tcfg = ModelConfig(**TINY_CONFIG["model"]), TrainConfig(**TINY_CONFIG["train"])
    models, opts = [], []
    for i in range(n):
        m = MoETransformer(mcfg, list(range(mcfg.n_experts)))
        m.init_weights(seed=0)
        x = torch.randint(0, mcfg.vocab_size, (2, 17), generator=torch.Generator().manual_seed(i))
        opt = build_optimizer(m, tcfg)
        m(x[:, :-1], targets=x[:, 1:]).loss.backward()  # each replica its own batch: moments differ
        opt.step()
        models.append(m)
        opts.append(opt)
    return models, opts


def test_averaged_moments_are_the_replicas_mean_in_every_slot():
    from benchmarks.replica_rounds import average_moments

    models, opts = _tiny_replicas(3)
    params = [[p for g in o.param_groups for p in g["params"]] for o in opts]
    before = [
        [{k: o.state[p][k].clone() for k in ("exp_avg", "exp_avg_sq")} for p in ps]
        for o, ps in zip(opts, params, strict=True)
    ]
    assert not torch.equal(before[0][0]["exp_avg"], before[1][0]["exp_avg"])
    average_moments(opts)
    for j in range(len(params[0])):
        for key in ("exp_avg", "exp_avg_sq"):
            mean = sum(b[j][key] for b in before) / 3
            for o, ps in zip(opts, params, strict=True):
                assert torch.allclose(o.state[ps[j]][key], mean, atol=1e-12, rtol=1e-6), (j, key)
            assert torch.equal(opts[0].state[params[0][j]][key], opts[2].state[params[2][j]][key])
    opts[2].param_groups[0]["params"] = opts[2].param_groups[0]["params"][1:]
    with pytest.raises(ValueError, match="differ"):
        average_moments(opts)


def _run_modes(config, data, peers: int, capsys, *extra: str) -> list[dict]:
    from benchmarks.update_averaging import main

    argv = ["--config", str(config), "--corpus", str(data), "--steps", "6", "--peers", str(peers), "--json"]
    assert main([*argv, *extra]) == 0
    return [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]


def test_every_mode_runs_and_with_one_peer_they_all_train_alike(tiny_data, tmp_path, capsys):
    """With one peer nothing is averaged, so data-parallel training (pooled or not), the every_step row and
    its moment averaging must give the same loss to the bit (same windows, schedule, clipping and AdamW);
    with two, averaging gradients and averaging weights must differ, and so must pooling the batches, by
    the load-balancing loss alone: without it, pooled and averaged gradients agree to rounding."""
    from benchmarks.update_averaging import MODES

    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump({**TINY_CONFIG, "data": {**TINY_CONFIG["data"], "path": str(tiny_data)}}))
    runs = {}
    for peers in (1, 2):
        rows = _run_modes(path, tiny_data, peers, capsys)
        assert [r["mode"] for r in rows] == list(MODES)
        assert rows[0]["ratio_to_central"] == 1.0
        for r in rows:
            assert math.isfinite(r["val_loss"]) and 0 < r["val_loss"] < 8.0, r
            assert (
                r["tokens"] == 6 * peers * TINY_CONFIG["data"]["micro_batch"] * TINY_CONFIG["data"]["seq_len"]
            )
            assert r["curve"][-1][1] == r["val_loss"] and len(r["curve"]) >= 2
        runs[peers] = {r["mode"]: r["val_loss"] for r in rows}
    one, two = runs[1], runs[2]
    assert one["pooled"] == one["gradients"] == one["weights"] == one["moments"], one
    assert two["gradients"] != two["weights"] and two["weights"] != two["moments"], two
    assert two["pooled"] != two["gradients"], two
    rows = _run_modes(
        path, tiny_data, 2, capsys, "--modes", "pooled", "gradients", "--set", "model.lb_loss_coef=0"
    )
    pooled, gradients = (r["val_loss"] for r in rows)
    assert abs(pooled - gradients) < 1e-4, (pooled, gradients)
    assert abs(two["pooled"] - two["gradients"]) > 10 * abs(pooled - gradients), (pooled, gradients, two)
    lines = _run_modes(path, tiny_data, 2, capsys, "--modes", "central", "weights", "--draw", "1", "0")
    drawn, again = lines[:2], lines[2:4]
    assert [(r["mode"], r["draw"]) for r in lines[:4]] == [
        ("central", 1),
        ("weights", 1),
        ("central", 0),
        ("weights", 0),
    ]
    assert [r["val_loss"] for r in again] == [two["central"], two["weights"]]  # 0: the default's windows
    assert drawn[0]["val_loss"] != two["central"] and drawn[1]["val_loss"] != two["weights"], (drawn, two)
    summaries = {s["summary"]: s for s in lines[4:]}
    assert summaries.keys() == {"central", "weights"} and len(lines) == 6
    assert summaries["weights"]["vs_central"]["ratio_mean"] == pytest.approx(
        (drawn[1]["val_loss"] / drawn[0]["val_loss"] + again[1]["val_loss"] / again[0]["val_loss"]) / 2
    )


def test_each_draw_gives_central_and_every_peer_windows_of_their_own(tiny_config):
    """No two samplers of the in-process rows share a stream, across peers, draws and central (whose batch
    from a peer's seed would be that peer's next batches laid end to end); draw 0 keeps the old seeds."""
    from benchmarks.replica_rounds import draw_seed, peer_samplers
    from swarm.config import load_config
    from swarm.data import WindowSampler
    from swarm.data.run_dataset import open_dataset

    cfg = load_config(tiny_config)
    ds = open_dataset(cfg, progress=False)
    assert [s.seed for s in peer_samplers(ds, cfg, 3)] == [1000, 1001, 1002]
    first = {}
    for draw in (0, 1, 2):
        central = WindowSampler(
            ds, cfg.data.seq_len, cfg.data.micro_batch, draw_seed(cfg.train.seed + 1, draw)
        )
        first[("central", draw)] = central.next_batch()
        for i, sampler in enumerate(peer_samplers(ds, cfg, 3, draw)):
            first[(i, draw)] = sampler.next_batch()
    batches = list(first.values())
    for a in range(len(batches)):
        for b in range(a):
            assert not torch.equal(batches[a], batches[b]), (list(first)[a], list(first)[b])
    with pytest.raises(ValueError, match="draw"):
        draw_seed(0, -1)


def test_summary_over_draws_pairs_each_draw_and_reads_back_earlier_runs(tmp_path, capsys):
    """The summary pairs modes draw by draw (a ratio of losses on the same windows), skips modes with one
    draw, refuses a draw counted twice, and --summarize reads it all back from --json files."""
    from benchmarks.update_averaging import main, summarize_draws

    rows = [{"mode": "central", "draw": 0, "val_loss": 5.0}, {"mode": "weights", "draw": 0, "val_loss": 5.5},
            {"mode": "central", "draw": 1, "val_loss": 4.0}, {"mode": "weights", "draw": 1, "val_loss": 4.2},
            {"mode": "central", "draw": 2, "val_loss": 6.0}, {"mode": "pooled", "draw": 2, "val_loss": 6.1}]  # fmt: skip
    summaries = {s["summary"]: s for s in summarize_draws(rows)}
    assert summaries.keys() == {"central", "weights"}  # pooled ran on one draw
    central, weights = summaries["central"], summaries["weights"]
    assert central["draws"] == [0, 1, 2] and central["val_loss_mean"] == pytest.approx(5.0)
    assert central["val_loss_sd"] == pytest.approx(1.0) and central["val_loss_min"] == 4.0
    assert weights["vs_central"]["draws"] == [0, 1]
    assert weights["vs_central"]["ratio_mean"] == pytest.approx((1.1 + 1.05) / 2)
    assert weights["vs_central"]["ratio_sd"] == pytest.approx(0.05 / 2**0.5)
    assert "vs_pooled" not in central  # one shared draw: no spread to give
    with pytest.raises(ValueError, match="twice"):
        summarize_draws(rows + [{"mode": "central", "draw": 1, "val_loss": 4.1}])

    first, second = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    first.write_text("\n".join(json.dumps(r) for r in rows[:4]) + "\nprogress text\n")
    second.write_text("\n".join(json.dumps(r) for r in rows[4:]) + "\n" + json.dumps(central) + "\n")
    assert main(["--summarize", str(first), str(second), "--json"]) == 0
    printed = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert printed == summarize_draws(rows)
    second.write_text('{"mode": "central", "draw": "one", "val_loss": 4.0}\n')
    with pytest.raises(SystemExit):
        main(["--summarize", str(first), str(second)])
    assert "integer draw" in capsys.readouterr().err
