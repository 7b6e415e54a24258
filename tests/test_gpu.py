"""GPU path: bf16 autocast training, torch.compile, the megablocks backend and a 2-peer swarm on CUDA.

Everything that needs CUDA skips cleanly without it. What can run on CPU also runs there at a tiny shape
(the demo's config choice, bf16 autocast against fp32, compiled against eager), so the test logic itself is
exercised on every machine::

    python -m pytest -q tests/test_gpu.py
"""

import subprocess
import time

import pytest
import torch

from swarm.config import ModelConfig, TrainConfig, load_config
from swarm.model import BackendUnavailable, MoETransformer, check_backend
from swarm.train import build_optimizer
from swarm.train.checkpoint import latest_checkpoint, load_checkpoint
from tests.conftest import ROOT, peer_cmd, reap, round_records, swarm_peer_args

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
SHAPE = dict(vocab_size=512, d_model=128, n_layers=2, n_heads=4, n_experts=8, expert_hidden=128, top_k=2)
# small enough that torch.compile of forward + backward takes well under a minute on 2 CPU cores
CPU_SHAPE = dict(vocab_size=256, d_model=32, n_layers=1, n_heads=2, n_experts=4, expert_hidden=32, top_k=2)
DEVICES = ["cpu", pytest.param("cuda", marks=cuda)]


def test_megablocks_on_cpu_is_a_clear_error():
    with pytest.raises(BackendUnavailable, match="megablocks"):
        check_backend("megablocks", torch.device("cpu"))


@cuda
@pytest.mark.parametrize("frozen", ["float32", "bfloat16"])
def test_bf16_autocast_step_trains_local_experts_only(frozen):
    model = MoETransformer(ModelConfig(**SHAPE), [0, 1], frozen)
    model.init_weights(0)
    model.cuda()
    before = model.canonical_state_dict()
    opt = build_optimizer(model, TrainConfig())
    x = torch.randint(0, 512, (4, 65), device="cuda")
    losses = []
    for _ in range(5):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model(x[:, :-1], targets=x[:, 1:])
        out.loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(out.lm_loss.item())
    assert losses[-1] < losses[0]
    after = model.canonical_state_dict()
    key = "layers.0.moe.experts.gate_up"
    assert torch.equal(before[key][2:], after[key][2:])
    assert not torch.equal(before[key][:2], after[key][:2])


@cuda
def test_gpu_matches_cpu_in_fp32():
    cpu = MoETransformer(ModelConfig(**SHAPE), [0, 1])
    cpu.init_weights(0)
    gpu = MoETransformer(ModelConfig(**SHAPE), [0, 1])
    gpu.init_weights(0)
    gpu.cuda()
    x = torch.randint(0, 512, (2, 33))
    with torch.no_grad():
        a = cpu(x).logits
        b = gpu(x.cuda()).logits.cpu()
    assert (a - b).abs().max().item() < 1e-3


@cuda
def test_megablocks_backend_matches_grouped_mm():
    try:
        check_backend("megablocks", torch.device("cuda"))
    except BackendUnavailable as e:
        pytest.skip(str(e))
    ref = MoETransformer(ModelConfig(**SHAPE), [0, 1, 2])
    ref.init_weights(0)
    mb = MoETransformer(ModelConfig(**SHAPE, moe_backend="megablocks"), [0, 1, 2])
    mb.init_weights(0)
    ref.cuda(), mb.cuda()
    x = torch.randint(0, 512, (2, 33), device="cuda")
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        assert (ref(x).logits - mb(x).logits).abs().max().item() < 5e-2


# -- the demo on a GPU machine -------------------------------------------------------------------------------
def test_demo_runs_the_cpu_config_without_cuda_and_the_gpu_one_with_it():
    from peers.demo import CPU_CONFIG, GPU_CONFIG, pick_config

    path, why = pick_config(None)
    assert path == str(GPU_CONFIG if torch.cuda.is_available() else CPU_CONFIG), why
    assert pick_config("my.yaml") == ("my.yaml", "given by --config")
    cpu, gpu = load_config(CPU_CONFIG), load_config(GPU_CONFIG)
    assert gpu.run_id != cpu.run_id  # a GPU demo never joins a CPU demo's swarm
    assert gpu.data.path == "stdlib" and gpu.data.stdlib_vocab_size == cpu.data.stdlib_vocab_size
    assert gpu.model.d_model > cpu.model.d_model and gpu.data.micro_batch > cpu.data.micro_batch
    assert gpu.train.max_steps > 10 * gpu.sync.sync_every  # the demo's --stop-at ends it, not max_steps


# -- numerics ---------------------------------------------------------------------------------------------
def _train(model: MoETransformer, batches, bf16: bool) -> list[float]:
    """A few real training steps (build_optimizer, clipping as the trainer does); the lm losses."""
    opt = build_optimizer(model, TrainConfig(lr=1e-3, warmup_steps=0))
    device = next(model.parameters()).device
    losses = []
    for x in batches:
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            out = model(x[:, :-1], targets=x[:, 1:])
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.trainable_parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        losses.append(out.lm_loss.item())
    return losses


@pytest.mark.parametrize("device", DEVICES)
def test_bf16_autocast_training_tracks_fp32(device):
    """bf16 autocast (what a CUDA peer runs) against fp32 from the same weights, 6 steps on one batch (so
    that the loss falls clearly): the loss curves agree within 2%, and every tensor's update (trained minus
    initial weights) within 25% of its norm (AdamW's first steps are ~lr whatever the gradient's size, so
    elementwise the two can differ by ~lr where a gradient is near zero)."""
    shape = SHAPE if device == "cuda" else CPU_SHAPE
    x = torch.randint(0, shape["vocab_size"], (4, 33), generator=torch.Generator().manual_seed(1)).to(device)
    runs = {}
    for bf16 in (False, True):
        model = MoETransformer(ModelConfig(**shape), [0, 1], "float32")
        model.init_weights(0)
        init = model.canonical_state_dict()
        model.to(device)
        runs[bf16] = (_train(model, [x] * 6, bf16), model.canonical_state_dict())
    (fp32, w32), (bf16, w16) = runs[False], runs[True]
    assert fp32[-1] < fp32[0] - 0.05 and bf16[-1] < bf16[0] - 0.05, (fp32, bf16)
    for a, b in zip(fp32, bf16, strict=True):
        assert abs(a - b) <= 0.02 * a, (fp32, bf16)
    for name, w0 in init.items():
        d32, d16 = w32[name].cpu() - w0, w16[name].cpu() - w0  # a CUDA model's state is on the device
        assert (d16 - d32).norm() <= 0.25 * d32.norm() + 1e-6, name


def _compiled_vs_eager(device: str, shape: dict) -> tuple[float, int]:
    """Same weights and batch through an eager model and a ``model.compile()``d one: forward loss and every
    gradient agree. Returns the seconds the compiled forward + backward took (compilation included) and
    the number of graph breaks dynamo reported."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    x = torch.randint(0, shape["vocab_size"], (2, 17), generator=torch.Generator().manual_seed(2)).to(device)
    grads, losses = [], []
    for compiled in (False, True):
        model = MoETransformer(ModelConfig(**shape), [0, 1], "float32")
        model.init_weights(0)
        model.to(device)
        if compiled:
            model.compile()
        t0 = time.perf_counter()
        out = model(x[:, :-1], targets=x[:, 1:])
        out.loss.backward()
        seconds = time.perf_counter() - t0
        losses.append(out.loss.item())
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    (eager, comp), (g_eager, g_comp) = losses, grads
    assert abs(eager - comp) <= 1e-4 * abs(eager), (eager, comp)
    assert g_eager.keys() == g_comp.keys() and g_eager
    for name, g in g_eager.items():
        scale = g.abs().max().item() + 1e-12
        assert (g_comp[name] - g).abs().max().item() <= 1e-3 * scale, name
    assert counters["stats"]["unique_graphs"] >= 1  # dynamo really compiled something
    return seconds, sum(counters["graph_break"].values())


def test_compiled_matches_eager_on_cpu():
    """Not skipped on CPU: the model must stay compile-friendly everywhere (tiny shape, 1 layer; ~20 s of
    compilation on 2 cores)."""
    seconds, breaks = _compiled_vs_eager("cpu", CPU_SHAPE)
    print(f"compiled forward + backward on CPU: {seconds:.1f} s with compilation, {breaks} graph breaks")


@cuda
def test_compiled_matches_eager_on_cuda():
    _compiled_vs_eager("cuda", SHAPE)


def test_work_handed_to_another_thread_runs_on_the_streams_of_the_thread_that_handed_it():
    """``on_this_stream``: a round's download threads read our GPU copies on the round's side stream, not on
    the default stream behind the training step's kernels. Without CUDA in use it changes nothing."""
    import threading

    from swarm.net.expert_tensors import on_this_stream, side_stream

    def stream_id():
        return torch.cuda.current_stream().stream_id if torch.cuda.is_initialized() else None

    if not torch.cuda.is_available():
        assert on_this_stream(stream_id) is stream_id
        return
    torch.cuda.init()
    seen = {}
    with side_stream(torch.device("cuda")):
        side = stream_id()
        handed, plain = on_this_stream(stream_id), stream_id
    for name, fn in (("handed", handed), ("plain", plain)):
        thread = threading.Thread(target=lambda n=name, f=fn: seen.__setitem__(n, f()))
        thread.start()
        thread.join(timeout=30)
    default = torch.cuda.default_stream().stream_id
    assert side != default and seen == {"handed": side, "plain": default}


# -- a swarm on the GPU ----------------------------------------------------------------------------------
@cuda
@pytest.mark.timeout(400)
def test_two_peer_swarm_on_cuda_applies_rounds_and_agrees(tiny_config, tmp_path, bootstrap_peer):
    """Two real ``swarm-peer`` processes with the model on CUDA (the averagers get host copies): rounds are
    applied, and after the last round the replicas agree."""
    runs = [tmp_path / f"p{i}" for i in range(2)]
    stop_at = time.time() + 90  # CUDA start-up and compilation come first; then rounds every 50 steps
    procs = []
    try:
        for run in runs:
            args = swarm_peer_args(tiny_config, bootstrap_peer, run, "--stop-at", str(stop_at), max_steps=400)
            cmd = peer_cmd(*args, "--set", "train.device=cuda")
            procs.append(
                subprocess.Popen(
                    cmd,
                    cwd=ROOT,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                    start_new_session=True,
                )
            )
        outs = [p.communicate(timeout=300) for p in procs]
    finally:
        reap(procs)
    for p, (_, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err[-3000:]
    rounds = [round_records(run) for run in runs]
    for rs in rounds:
        applied = [r for r in rs if r.dense_group == 2 and "dense" in r.applied_groups]
        assert applied, rs
        assert not any("NaN" in why for r in rs for why in r.rejected)
    final = [rs[-1] for rs in rounds]
    assert all(r.last and r.final_unsettled == [] for r in final), final
    ckpts = [load_checkpoint(latest_checkpoint(run / "checkpoints")) for run in runs]
    assert all(c.state["local_experts"] for c in ckpts)
    adopted = {name for r in final for name in r.final_adopted}
    a, b = (c.model for c in ckpts)
    for key, ref in a.items():
        if ".experts." in key or "dense" in adopted:  # downloaded copies travel in fp16
            tol = 2e-3 * ref.abs().max().item()
        else:
            tol = 1e-5
        assert torch.allclose(b[key], ref, atol=tol, rtol=0), key
