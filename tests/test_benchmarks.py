"""Smoke tests of benchmarks/memory.py, step_speed.py, gpu_step.py, round_cpu.py (tiny shapes) and
aggregation.py (seconds, no speed asserts).

Each script runs as a subprocess with ``--tiny --json``; the tests check the exit code and the ratios the
JSON reports. Timings are never asserted (the machine is shared and noisy): only that they were measured.
The memory ratio in tensor accounting is deterministic, so it is checked against the arithmetic prediction.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time
from pathlib import Path

import pytest

from swarm.net.p2p_sockets import YOUNG_S, p2p_sockets, remove_stale_p2p_sockets
from tests.conftest import reap

ROOT = Path(__file__).resolve().parents[1]


# name: the script and its arguments. The runs start together, once per module: each is one process
# (memory.py starts one more per variant) that spends most of its time importing or waiting, so that side by
# side they take about as long as the slowest one alone.
RUNS = {
    "memory": ["memory.py", *"--tiny --layers 1 --threads 1 --json".split()],
    "step_speed": ["step_speed.py", *"--tiny --layers 1 --threads 1 --warmup 1 --rounds 2 --json".split()],
    "gpu_step": ["gpu_step.py", *"--device cpu --tiny --json --peak-tflops 1".split()],
    "gpu_step_bare": ["gpu_step.py"],  # no arguments: skips on a machine without CUDA
    "aggregation": ["aggregation.py", *"--repeats 1 --members 2 3 --json".split()],
    "heartbeats": ["heartbeats.py", *"--peers 2 --settle-s 3 --measure-s 5 --json".split()],
    "round_cpu": [
        "round_cpu.py",
        *(
            "--device cpu --repeats 1 --rate-s 0.5 --json --set model.vocab_size=512 --set "
            "model.d_model=64 --set model.n_layers=2 --set model.expert_hidden=64 --set "
            "data.micro_batch=1 --set data.seq_len=16"
        ).split(),
    ],
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """``{name: (Popen, stdout file, stderr file)}``: every script of RUNS, started at once (output to files,
    so that no script waits on a full pipe while another is read). gpu_step.py without arguments runs its
    full benchmark where CUDA is present: there it is left out."""
    import torch

    logs = tmp_path_factory.mktemp("benchmarks")
    procs, sockets_before = {}, p2p_sockets()
    try:
        for name, (script, *args) in RUNS.items():
            if name == "gpu_step_bare" and torch.cuda.is_available():
                continue
            out, err = logs / f"{name}.out", logs / f"{name}.err"
            with open(out, "w") as fo, open(err, "w") as fe:
                proc = subprocess.Popen(
                    [sys.executable, str(ROOT / "benchmarks" / script), *args],
                    stdout=fo,
                    stderr=fe,
                    cwd=ROOT,
                    start_new_session=True,  # its own process group: killed with its DHT's processes
                )
            procs[name] = (proc, out, err)
        yield procs
    finally:  # a test that failed early, or was not selected, leaves its script running
        if reap([proc for proc, _, _ in procs.values()]):
            time.sleep(YOUNG_S)  # a killed daemon's socket may be younger than what counts as stale
            remove_stale_p2p_sockets(sockets_before)  # its daemons could not remove their own


def _finished(run: tuple, timeout: int) -> subprocess.CompletedProcess:
    proc, out, err = run
    proc.wait(timeout=timeout)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out.read_text(), err.read_text())


def _stdout(runs: dict, name: str, timeout: int = 180) -> str:
    """A benchmark script's standard output, after checking that it exited 0."""
    proc = _finished(runs[name], timeout)
    script = RUNS[name][0]
    assert proc.returncode == 0, f"{script} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr[-3000:]}"
    return proc.stdout


def _run(runs: dict, name: str) -> dict:
    return json.loads(_stdout(runs, name))


def test_aggregation_benchmark_times_every_rule_per_group_size(runs):
    rows = [json.loads(line) for line in _stdout(runs, "aggregation").splitlines()]
    assert [r["members"] for r in rows] == [2, 3]
    for r in rows:
        assert r["mean_s"] > 0 and r["centered_clip_s"] > 0 and r["centered_trim_s"] > 0
        assert "centered_trim_extra_vs_link" in r and r["bytes_ratio"] == 1.0
        assert r["values"] > 1_000_000  # the demo's dense weights


def test_memory_benchmark_tiny(runs):
    r = _run(runs, "memory")
    assert r["shape"]["n_layers"] == 1 and r["shape"]["local_experts"] == 4
    assert [row["variant"] for row in r["rows"]] == ["all", "local-fp32", "local-bf16"]
    ratios = {q["frozen_dtype"]: q for q in r["ratios"]}
    assert set(ratios) == {"float32", "bfloat16"}
    for q in ratios.values():
        assert 0 < q["predicted"] < 1
        assert abs(q["tensor_rel_diff"]) <= 0.05 and q["tensor_pass"]
        assert q["rss"] > 0  # measured; RSS at a tiny shape is dominated by allocator noise: not asserted
    assert ratios["bfloat16"]["predicted"] < ratios["float32"]["predicted"]
    for row in r["rows"]:  # the tensor accounting is exact up to the small non-weight buffers
        assert 0 <= row["tensor_bytes"] - row["predicted_bytes"] < 4096


def test_step_speed_benchmark_tiny(runs):
    r = _run(runs, "step_speed")
    assert r["hf_experts_implementation"] == "grouped_mm"
    assert r["expert_ops"]["hf-olmoe"].get("aten._grouped_mm", 0) >= 2
    assert r["loss_difference"] < 1e-4  # same weights, same batch, same loss
    assert set(r["variants"]) == {"ours-all", "ours-4of16", "hf-olmoe"}
    for v in r["variants"].values():
        assert len(v["times_s"]) == 2 and all(t > 0 for t in v["times_s"])
    for key, goal in (("ours_vs_hf", 1.1), ("local_vs_all", 0.9)):
        q = r["ratios"][key]
        assert q["goal"] == goal
        assert math.isfinite(q["ratio_of_medians"]) and q["ratio_of_medians"] > 0


def test_gpu_step_benchmark_cpu_tiny(runs):
    """benchmarks/gpu_step.py's machinery on CPU at a tiny shape: every row, every ratio, the 2-peer round."""
    # one JSON object per line
    recs = [json.loads(line) for line in _stdout(runs, "gpu_step").splitlines() if line.startswith("{")]
    config = [r for r in recs if r["kind"] == "config"]
    rows = {r["row"]: r for r in recs if r["kind"] == "row"}
    ratios = {r["name"]: r for r in recs if r["kind"] == "ratio"}
    rounds = [r for r in recs if r["kind"] == "round"]
    assert len(config) == 1 and config[0]["peak_tflops"] == 1.0 and config[0]["compile"] is False
    fpt = config[0]["flops_per_token"]
    # the formula it states, by hand for the tiny shape: 2 layers, d 64, 4 heads, 16 experts x 64, vocab 512
    n_active = 2 * (64 * 16 * (2 * 4 + 2 * 4) + 64 * 16 + 2 * 3 * 64 * 64) + 64 * 512
    assert fpt == 6 * n_active + 12 * 2 * 32 * 64
    assert list(rows) == ["ours-all", "ours-4of16", "hf-olmoe", "ours-4of16-mb-ac", "ours-4of16-mb"]
    for r in rows.values():
        assert "error" not in r and "compile_error" not in r, r
        assert r["tokens_per_s"] > 0 and len(r["step_times_s"]) == 2
        assert math.isclose(r["mfu"], r["tokens_per_s"] * fpt / 1e12, rel_tol=1e-9)
        assert r["peak_bytes"] is None and r["state_bytes"] > 0  # no peak memory measure on CPU
        assert abs(r["loss_first"] - math.log(512)) < 0.5  # random weights, random tokens
    assert rows["ours-4of16-mb-ac"]["activation_checkpointing"] is True
    assert 0 < ratios["state bytes 4of16 / all"]["value"] < 1
    assert ratios["tokens/s ours-all / hf-olmoe"]["value"] > 0
    assert ratios["peak memory 4of16 / all (same batch)"]["met"] is None  # not measured on CPU
    assert len(rounds) == 1 and "error" not in rounds[0], rounds
    rnd = rounds[0]
    assert rnd["group_sizes"] == [2, 2] and rnd["max_abs_error_vs_mean"] < 1e-6
    assert rnd["round_s"] >= rnd["average_s"] > 0 and 0 <= rnd["copy_fraction"] <= 1


def test_gpu_step_benchmark_skips_without_cuda(runs):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the benchmark would run")
    proc = _finished(runs["gpu_step_bare"], timeout=60)
    assert proc.returncode == 0 and proc.stdout.startswith("gpu_step: skipped: no CUDA device"), proc
    assert len(proc.stdout.strip().splitlines()) == 1


def test_wan_codecs_are_one_codec_or_the_experts_and_the_dense_groups():
    from benchmarks.wan import parse_args

    assert parse_args(["--codecs", "int8/int4,fp32"]).codecs == ["int8/int4", "fp32"]
    for bad in ("int3", "int8/int3", "int8/"):
        with pytest.raises(SystemExit):
            parse_args(["--codecs", bad])


def test_wan_round_fit_separates_a_rounds_fixed_seconds_from_its_payloads():
    from benchmarks.wan import round_fit

    # rounds of 0.76 s + 1.2 x payload, as the H100 machine's int8 rounds came out
    points = [(p, 0.76 + 1.2 * p) for p in (0.4, 0.45, 3.4, 3.5, 2.1)]
    assert round_fit(points) == {"fixed_s": 0.76, "per_payload": 1.2}
    assert round_fit(points[:2]) is None  # too few rounds to tell
    assert round_fit([(1.0, 2.0), (1.0, 2.5), (1.0, 3.0)]) is None  # payloads all alike: no slope
    assert round_fit([(4.56, 5.4), (4.57, 5.9), (4.6, 5.6)]) is None  # nearly alike (fp32 rounds)


def test_wan_link_ratios_divide_a_round_by_its_payloads_time_with_or_without_each_peers_first():
    from benchmarks.wan import link_ratios

    # 25 MB each way at 100 Mbit/s take 2 s
    by_peer = [
        [(6.0, 50_000_000), (2.6, 50_000_000)],
        [(5.0, 25_000_000), (1.5, 25_000_000), (1.2, 25_000_000)],
    ]
    assert link_ratios(by_peer, 100) == pytest.approx([3.0, 1.3, 5.0, 1.5, 1.2])
    assert link_ratios(by_peer, 100, skip_first=True) == pytest.approx([1.3, 1.5, 1.2])
    assert link_ratios([[(4.0, 50_000_000)]], 100, skip_first=True) == []


def test_link_use_finds_a_rounds_idle_head_and_tail_on_its_busier_direction():
    from benchmarks.link_use import LinkSampler, link_use

    rate = 1000.0  # bytes per second each way; samples every 0.1 s from t = 10
    # received: idle for 0.3 s, then at the full rate for 1.0 s, then 10% of it for 0.2 s; sent: a trickle
    recv, samples = 0, []
    for k in range(16):
        t = 10.0 + 0.1 * k
        samples.append((round(t, 3), 5 * k, recv))
        recv += 0 if k < 3 else 100 if k < 13 else 10
    use = link_use(samples, 10.0, 11.5, rate)
    assert use.head_s == pytest.approx(0.3) and use.tail_s == pytest.approx(0.2)
    assert use.busy == pytest.approx(1020 / rate / 1.5)  # the bytes received need 1.02 s of the round's 1.5
    assert link_use(samples, 10.0, 10.05, rate) is None  # one sample: nothing to tell
    idle = [(10.0 + 0.1 * k, 0, 0) for k in range(5)]
    nothing = link_use(idle, 10.0, 10.4, rate)
    assert (nothing.busy, nothing.tail_s) == (0.0, 0.0) and nothing.head_s == pytest.approx(0.4)

    counts = iter(range(10**6))
    with LinkSampler(lambda host: (host, next(counts)), hosts=[1, 2], period_s=0.01) as sampler:
        time.sleep(0.1)
    rows = sampler.samples(2)
    assert len(rows) >= 3 and all(sent == 2 for _, sent, _ in rows)
    assert [t for t, *_ in rows] == sorted(t for t, *_ in rows)
    assert all(b[2] > a[2] for a, b in zip(rows, rows[1:], strict=False))  # read afresh every time


def test_a_coded_average_is_the_plain_mean_within_the_codecs_error():
    """coded_average (the every_step rows with --average-codec): replicas that start alike and change
    differently end within two int8 steps of the plain mean (their change out, the mean's back), and a
    frozen copy within three of its trainers' mean."""
    import copy

    import torch

    from benchmarks.coded_average import CodedAverage
    from benchmarks.replica_rounds import average_replicas
    from swarm.config import ModelConfig
    from swarm.model import MoETransformer
    from swarm.sync.codecs import codec_named
    from tests.conftest import TINY_CONFIG

    mcfg = ModelConfig(**TINY_CONFIG["model"])
    owned = [[0, 1], [1, 2], [3]]
    models = []
    for own in owned:
        m = MoETransformer(mcfg, own)
        m.init_weights(seed=0)  # one initialisation, as a swarm's peers share
        models.append(m)
    coded = CodedAverage(codec_named("int8"), models, owned, mcfg.n_experts)
    gen = torch.Generator().manual_seed(1)
    for m in models:  # each replica's own training
        state = m.canonical_state_dict()
        m.load_canonical_state_dict(
            {k: v + 0.01 * torch.randn(v.shape, generator=gen) for k, v in state.items()}
        )
    plain = [copy.deepcopy(m) for m in models]
    average_replicas(plain, owned, mcfg.n_experts)
    coded(models)
    want, got = plain[0].canonical_state_dict(), [m.canonical_state_dict() for m in models]
    step = 0.01 * 5 / 127  # an int8 step for changes of about 5 sigma at most
    worst = 0.0
    for name, value in want.items():
        parts = [slice(None)] if ".experts." not in name else [0, 1, 2, 3]  # 4-7: nobody trains them
        for part in parts:
            for i, g in enumerate(got):
                bound = 3 * step if ".experts." in name and part not in owned[i] else 2 * step
                err = float((g[name][part] - value[part]).abs().max())
                assert err <= bound, (name, part, i, err)
                worst = max(worst, err)
    assert worst > 0  # the codec did drop something: this is not the plain mean again


def test_a_coded_average_of_one_part_leaves_the_other_and_its_reference_alone():
    """coded_average with split intervals (``--average-experts-every`` with a codec): a round of the dense
    weights leaves every expert bit for bit; the experts' next round still codes each change from the state
    last agreed for them, so the replicas agree again, within the codec's error of their trainers' mean."""
    import copy

    import torch

    from benchmarks.coded_average import CodedAverage
    from benchmarks.replica_rounds import average_replicas
    from swarm.config import ModelConfig
    from swarm.model import MoETransformer
    from swarm.sync.codecs import codec_named
    from tests.conftest import TINY_CONFIG

    mcfg = ModelConfig(**TINY_CONFIG["model"])
    owned = [[0, 1], [1, 2], [3]]
    models = []
    for own in owned:
        m = MoETransformer(mcfg, own)
        m.init_weights(seed=0)
        models.append(m)
    coded = CodedAverage(codec_named("int8"), models, owned, mcfg.n_experts)
    gen = torch.Generator().manual_seed(2)

    def train() -> list[dict]:  # each replica's own steps
        for m in models:
            state = m.canonical_state_dict()
            m.load_canonical_state_dict(
                {k: v + 0.01 * torch.randn(v.shape, generator=gen) for k, v in state.items()}
            )
        return [m.canonical_state_dict() for m in models]

    before = train()
    plain = [copy.deepcopy(m) for m in models]
    average_replicas(plain, owned, mcfg.n_experts, experts=False)
    coded(models, experts=False)
    after = [m.canonical_state_dict() for m in models]
    step = 0.01 * 5 / 127  # an int8 step for changes of about 5 sigma at most
    for name, value in plain[0].canonical_state_dict().items():
        if ".experts." in name:
            assert all(torch.equal(a[name], b[name]) for a, b in zip(after, before, strict=True)), name
        else:
            assert all(float((a[name] - value).abs().max()) <= 2 * step for a in after), name
    before = train()
    plain = [copy.deepcopy(m) for m in models]
    average_replicas(plain, owned, mcfg.n_experts, dense=False)
    coded(models, dense=False)
    after = [m.canonical_state_dict() for m in models]
    for name, value in plain[0].canonical_state_dict().items():
        if ".experts." not in name:
            assert all(torch.equal(a[name], b[name]) for a, b in zip(after, before, strict=True)), name
            continue
        for e in range(4):  # two rounds of changes in one code: about twice the spread
            for i, a in enumerate(after):
                bound = (3 if e not in owned[i] else 2) * 2 * step
                assert float((a[name][e] - value[e]).abs().max()) <= bound, (name, e, i)


def test_stream_rate_plans_who_takes_from_whom_in_every_case():
    from benchmarks.stream_rate import parse_args, schedule, slot_s, takers

    assert takers("p2p_one_way", 4) == {1: [0]} and takers("tcp_both_ways", 4) == {0: [1], 1: [0]}
    assert takers("p2p_all_to_all", 3) == {0: [1, 2], 1: [0, 2], 2: [0, 1]}
    two = parse_args(["--hosts", "2", "--streams", "1,4", "--repeats", "2"])
    assert schedule(two) == [(c, k) for c, k in [
        ("tcp_one_way", 1), ("tcp_both_ways", 1),
        ("p2p_one_way", 1), ("p2p_both_ways", 1), ("p2p_one_way", 4), ("p2p_both_ways", 4),
    ] for _ in range(2)]  # fmt: skip
    four = parse_args(["--mbit", "20", "--mb", "5"])  # the all-to-all cases only with three hosts or more
    assert [c for c, _ in schedule(four)].count("p2p_all_to_all") == 2 * 3  # streams 1 and 4, 3 repeats
    assert slot_s(four) == 3 * 5 * 8 / 20 + 2.0
    for bad in (["--hosts", "1"], ["--streams", "0"], ["--mb", "0"]):
        with pytest.raises(SystemExit):
            parse_args(bad)


def test_round_cpu_benchmark_times_every_part_alone_and_beside_training(runs):
    from benchmarks.round_cpu import PARTS

    *rows, summary = [json.loads(line) for line in _stdout(runs, "round_cpu").splitlines()]
    assert [r["part"] for r in rows] == list(PARTS)
    for r in rows:
        assert r["ops"] > 0 and r["idle_ms"] > 0 and r["training_ms"] > 0 and r["ratio"] > 0, r
    assert summary["device"] == "cpu" and summary["steps_per_s_alone"] > 0
    # op counts are exact: the digest takes a dozen ops per tensor, not a dozen per segment of each
    digest = rows[PARTS.index("digest")]
    assert digest["ops"] <= 20 * digest["tensors"], digest


def test_heartbeats_benchmark_measures_both_crawls_side_by_side(runs):
    *rows, summary = [json.loads(line) for line in _stdout(runs, "heartbeats").splitlines()]
    assert [(r["peers"], r["crawl"]) for r in rows] == [(2, "hivemind"), (2, "swarm")]
    for r in rows:
        assert 0 < r["mean_bytes"] <= r["max_bytes"] and r["min_view"] == 2, r  # each read found both peers
    assert summary["peers"] == 2 and summary["ratio"] > 0
