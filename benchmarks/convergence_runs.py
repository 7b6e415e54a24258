"""The runs that ``convergence.py`` compares, each at the same number of tokens, and the one evaluator.

    data = prepare_corpus(Path("../shared/data/docs-corpus.txt.xz"), work, mb=12)   # or "stdlib"
    central = run_central(cfg, steps=250, peers=4, work=work / "central")           # OlmoeForCausalLM
    swarm = run_swarm(cfg, steps=250, peers=4, work=work / "swarm", transport="process")
    heldout_loss(hf_model, cfg)                      # the evaluator every run is judged by

Every run starts from the same initial weights (our ``init_weights``, also loaded into the HF model) and
sees ``steps x peers x micro_batch`` windows in all. The centralized reference is transformers' own
``OlmoeForCausalLM`` trained on the peers' combined batch with the same AdamW, schedule and clipping; a
swarm runs real ``swarm-peer`` processes on 127.0.0.1 (``transport="process"``: the swarm as shipped), or
the same peers as threads of this process on the in-memory transport (``"local"``: the same rounds,
deterministic timing, no sockets; for tests and quick sweeps). A swarm's result is peer 0's final
checkpoint, after the last round and the final agreement, as an HF model: the export mapping of
``swarm-export``. The evaluator is ``swarm.eval.val_bpb.validation_bpb``'s loss on the first
``val_windows`` windows of the held-out shard, the same for every run.
"""

from __future__ import annotations

import copy
import lzma
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class RunResult:
    """One row: its final held-out loss, its curve (tokens, loss), bytes per peer, wall time."""

    name: str
    val_loss: float
    tokens: int
    wall_s: float
    bytes_per_peer: float = 0.0
    curve: list[tuple[int, float]] = field(default_factory=list)
    rounds_applied: int = 0  # peer 0's rounds whose dense average it applied
    rounds_started: int = 0  # peer 0's rounds (not the sync points it skipped)
    notes: str = ""


def prepare_corpus(source: str, work: Path, mb: float = 12.0, vocab: int = 4096) -> str:
    """A dataset directory for ``data.path`` made with the project's own tools (``train_bpe_tokenizer``,
    ``prepare``), or "stdlib" for the embedded corpus. A ``.xz`` / ``.txt`` file is cut into 100 kB
    documents (its first ``mb`` MB); a glob of ``.txt``/``.jsonl``/``.parquet`` files is taken as it is; a
    prepared dataset directory is used as it is."""
    if source == "stdlib":
        return "stdlib"
    if (Path(source) / "manifest.json").exists():  # a dataset ``swarm-data prepare`` already made
        return str(Path(source).resolve())
    from swarm.data import prepare, train_bpe_tokenizer

    out = work / "dataset"
    if (out / "manifest.json").exists():
        return str(out)
    docs = work / "docs"
    docs.mkdir(parents=True, exist_ok=True)
    path = Path(source)
    if path.suffix in (".xz", ".txt"):
        opener = lzma.open if path.suffix == ".xz" else open
        with opener(path, "rt", encoding="utf-8", errors="replace") as fh:
            text = fh.read(int(mb * 1e6))
        step = 100_000
        for i in range(0, len(text), step):
            (docs / f"doc{i // step:05d}.txt").write_text(text[i : i + step], encoding="utf-8")
        inputs = [str(docs / "*.txt")]
    else:
        inputs = [source]
    tok = train_bpe_tokenizer(inputs, vocab, work / "tokenizer.json")
    prepare(inputs, tok, out, num_workers=2, progress=False)
    return str(out)


def heldout_loss(hf_model, cfg, windows: int | None = None, device: str = "cpu") -> float:
    """Mean cross-entropy (nats per token) of a HF causal LM on the held-out windows of ``cfg``'s data."""
    from swarm.data.run_dataset import open_dataset
    from swarm.eval.val_bpb import validation_bpb

    ds = open_dataset(cfg, progress=False)
    n = windows or cfg.data.val_batches * cfg.data.micro_batch
    hf_model.eval()
    res = validation_bpb(
        hf_model,
        ds,
        cfg.data.seq_len,
        batch_size=cfg.data.micro_batch,
        max_batches=max(1, n // cfg.data.micro_batch),
        device=device,
    )
    return float(res["loss"])


def hf_model_from(cfg, canonical: dict[str, torch.Tensor]):
    """``OlmoeForCausalLM`` holding these weights (our canonical names), as ``swarm-export`` maps them."""
    from transformers import OlmoeForCausalLM

    from swarm.model.hf_olmoe import olmoe_config, to_olmoe_state_dict

    # no end-of-text token: only the held-out loss is asked of it (OLMoE's default id lies outside our vocab)
    model = OlmoeForCausalLM(olmoe_config(cfg.model, eos_token_id=None))
    missing, unexpected = model.load_state_dict(to_olmoe_state_dict(canonical), strict=False)
    if unexpected or [k for k in missing if "rotary" not in k]:
        raise RuntimeError(f"export mapping: missing {missing}, unexpected {unexpected}")
    return model


def initial_canonical(cfg) -> dict[str, torch.Tensor]:
    from swarm.model import MoETransformer

    model = MoETransformer(cfg.model, list(range(cfg.model.n_experts)))
    model.init_weights(cfg.train.seed)
    return model.canonical_state_dict()


def run_central(cfg, steps: int, peers: int, eval_every: int, device: str = "cpu", sampler=None,
                draw: int = 0) -> RunResult:  # fmt: skip
    """``OlmoeForCausalLM`` on batches of ``peers x micro_batch`` windows: AdamW (matrices decay, experts at
    ``train.expert_lr_scale`` times the rate, as the trainer's), the trainer's schedule and gradient
    clipping; its loss is HF's own (LM + router aux loss). ``sampler``: other windows (``next_batch``);
    ``draw``: the ``draw``-th draw of its own (``replica_rounds.draw_seed``)."""
    from benchmarks.replica_rounds import draw_seed
    from swarm.data import WindowSampler
    from swarm.data.run_dataset import open_dataset
    from swarm.train.optimizer import adamw_groups, set_lr
    from swarm.train.schedule import lr_at

    t0, t = time.monotonic(), cfg.train
    torch.manual_seed(t.seed)
    model = hf_model_from(cfg, initial_canonical(cfg)).to(device)
    model.config.output_router_logits = True
    opt = torch.optim.AdamW(adamw_groups(model.named_parameters(), t), lr=t.lr, betas=t.betas, eps=t.eps)
    batch = peers * cfg.data.micro_batch
    sampler = sampler or WindowSampler(
        open_dataset(cfg, progress=False), cfg.data.seq_len, batch, seed=draw_seed(t.seed + 1, draw)
    )
    curve, tokens = [(0, heldout_loss(model, cfg, device=device))], 0
    model.train()
    for step in range(steps):
        set_lr(opt, lr_at(step, t))
        # seq_len + 1 tokens: HF shifts the labels inside, so it predicts seq_len
        ids = sampler.next_batch().to(device)
        out = model(input_ids=ids, labels=ids, use_cache=False)
        out.loss.backward()
        if t.grad_clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        tokens += batch * cfg.data.seq_len
        if (step + 1) % eval_every == 0 or step + 1 == steps:
            curve.append((tokens, heldout_loss(model, cfg, device=device)))
            model.train()
    return RunResult("central", curve[-1][1], tokens, time.monotonic() - t0, curve=curve)


def run_swarm(name: str, cfg_path: Path, overrides: list[str], steps: int, peers: int, work: Path,
              transport: str) -> RunResult:  # fmt: skip
    """A swarm of ``peers`` peers, ``steps`` steps each, then its last round: real processes or threads."""
    from swarm.config import load_config
    from swarm.train.checkpoint import latest_checkpoint, load_checkpoint
    from swarm.train.metrics_log import read_metrics

    t0 = time.monotonic()
    work.mkdir(parents=True, exist_ok=True)
    runs = [work / f"peer{i}" for i in range(peers)]
    if transport == "process":
        _swarm_processes(cfg_path, overrides, steps, runs, work)
    else:
        _swarm_threads(load_config(cfg_path, overrides), steps, runs)
    wall = time.monotonic() - t0
    cfg = load_config(cfg_path, overrides)
    final = load_checkpoint(latest_checkpoint(runs[0] / "checkpoints"))
    loss = heldout_loss(hf_model_from(cfg, final.model), cfg)
    records = [read_metrics(r / "metrics.jsonl") for r in runs]
    rounds = [[m for m in recs if "dense_group" in m] for recs in records]
    moved = [_bytes_moved(rs) for rs in rounds]
    tokens_per_step = cfg.data.micro_batch * cfg.data.seq_len * cfg.train.grad_accum
    curve = [(m["step"] * tokens_per_step * peers, m["val_loss"]) for m in records[0] if "val_loss" in m]
    applied = sum(1 for m in rounds[0] if {"dense", "core"} & set(m.get("applied_groups") or []))
    started = sum(1 for m in rounds[0] if not m.get("reason"))
    return RunResult(name, loss, final.step * tokens_per_step * peers, wall, sum(moved) / peers,
                     curve, applied, started)  # fmt: skip


def _bytes_moved(rounds: list[dict]) -> float:
    """What a peer's p2pd carried by its last round, both directions (rounds, the copies it served to
    others, the DHT): the round records' ``wire_total``. Without a p2pd (threads), the rounds' payload by
    arithmetic, which leaves out the copies served."""
    wire = [m["wire_total"] for m in rounds if m.get("wire_total") is not None]
    return wire[-1] if wire else sum(m.get("bytes_sent", 0) + m.get("bytes_recv", 0) for m in rounds)


def _swarm_processes(cfg_path: Path, overrides: list[str], steps: int, runs: list[Path], work: Path) -> None:
    from peers.demo import wait_for_maddr

    py, env = sys.executable, {**os.environ, "PYTHONUNBUFFERED": "1"}
    procs: list[subprocess.Popen] = []

    def start(cmd: list[str], log: Path) -> subprocess.Popen:
        with open(log, "w") as fh:
            procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=fh, stderr=subprocess.STDOUT,
                                          start_new_session=True))  # fmt: skip
        return procs[-1]

    threads = max(1, (os.cpu_count() or 1) // len(runs))  # as swarm-demo: no core oversubscribed
    sets = ["--set", f"train.threads={threads}", *(a for kv in overrides for a in ("--set", kv))]
    sets += ["--set", f"run_id=conv-{os.getpid()}-{work.name}"]
    try:
        maddr = wait_for_maddr(
            work / "bootstrap.log", start([py, "-m", "bootstrap.main"], work / "bootstrap.log")
        )
        peers = [start([py, "-m", "peers.main", "--config", str(cfg_path), "--initial-peers", maddr,
                        "--run-dir", str(run), "--max-steps", str(steps), "--no-progress", *sets],
                       work / f"{run.name}.log") for run in runs]  # fmt: skip
        codes = [p.wait(timeout=3600) for p in peers]
        if any(codes):
            raise RuntimeError(f"{work.name}: peer exit codes {codes} (logs in {work})")
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
                try:
                    p.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()


def _swarm_threads(cfg, steps: int, runs: list[Path]) -> None:
    """The peers as threads on ``LocalNetwork``: the same trainer, rounds, last round and final agreement
    as ``swarm-peer``, with claims settled at once (``settle_joiners``) instead of through a DHT."""
    from swarm.net.local_transport import LocalNetwork
    from swarm.net.membership import Membership
    from swarm.net.swarm_sync import SwarmSync
    from swarm.net.timing import Timing
    from swarm.sync import settle_joiners
    from swarm.train.sync_hook import NoSync
    from swarm.train.trainer import Trainer

    ids = [f"peer{i}" for i in range(len(runs))]
    per_peer = cfg.experts.per_peer or cfg.model.n_experts
    claims = settle_joiners(
        {e: frozenset() for e in range(cfg.model.n_experts)}, ids, cfg.model.n_experts, per_peer
    )
    net, timing, trainers = (
        LocalNetwork(matchmaking_s=cfg.sync.matchmaking_s),
        Timing.from_config(cfg.sync),
        [],
    )
    for me, run in zip(ids, runs, strict=True):
        peer_cfg = copy.deepcopy(cfg)
        peer_cfg.data.seed = 1000 + len(trainers)  # each peer samples its own windows
        peer_cfg.train.threads = 1  # torch's thread count is the process's: the peers share it
        trainer = Trainer(peer_cfg, run, sync=NoSync(), progress=False)
        trainer.setup(local_experts=claims[me])
        members = Membership(net.store(me), me, cfg.run_id, timing, claims[me], cfg.model.n_experts,
                             cfg.sync.orphan_grace_s)  # fmt: skip
        trainer.sync = SwarmSync(peer_cfg, net.store(me), net.transport(me), trainer.model, members)
        trainers.append(trainer)
    for trainer in trainers:  # every peer sees the others before the first step, as a joiner would
        trainer.sync.members.refresh()
    errors: list[BaseException] = []

    def train(trainer) -> None:
        try:
            trainer.train(max_steps=steps)
        except BaseException as e:  # reported below, with the others' results
            errors.append(e)
        finally:
            trainer.close()

    threads = [threading.Thread(target=train, args=(t,), name=f"peer{i}") for i, t in enumerate(trainers)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    if errors:
        raise errors[0]
