"""The in-process rows of ``convergence.py`` (``every_step``, ``every_step_spes``): four replicas of our model
averaged in this process, with no network and no timing, as a swarm's rounds would average them at best.

    res = run_every_step(cfg, steps=140, peers=4, eval_every=20, every=10, own_experts=True,
                         experts_every=40, pooled_moment=True)     # the swarm's spacing, in process
    unmodelled(split, delay, outer, merge, lossless)               # "" or why a combination is not modelled

Judged by ``convergence_runs.heldout_loss``, as every other row.
"""

from __future__ import annotations

import time

import torch

from benchmarks.convergence_runs import RunResult, heldout_loss, hf_model_from


def unmodelled(split: bool, delay: int, outer: bool, merge: bool, lossless: bool,
               embeddings: bool = False, early: bool = False) -> str:  # fmt: skip
    """Why ``run_every_step`` cannot model a combination of its settings (``--average-*``), or "": an outer
    step takes no lossy codec and no split intervals, late averages and embeddings on an interval of their
    own plain averaging only, and an early schedule sets the interval of all the dense weights."""
    if early and embeddings:
        return "--average-early sets the interval of all dense weights: not with --average-embeddings-every"
    if embeddings and (outer or merge or delay or not lossless):
        return "--average-embeddings-every averages plainly: no codec, outer step, delay or merge"
    if outer and not lossless:
        return "--average-outer takes no lossy codec (--average-codec, --average-dense-codec)"
    if split and outer:
        return "--average-experts-every takes no outer step (--average-outer)"
    if delay and (outer or merge or not lossless):
        return "--average-delay averages plainly: no codec, outer step or merge"
    return ""


def run_every_step(cfg, steps: int, peers: int, eval_every: int, every: int = 1, own_experts: bool = False,
                   device: str = "cpu", codec: str = "fp32", dense_codec: str = "",
                   outer: tuple[float, float] = (1.0, 0.0), merge: bool = False,
                   experts_every: int = 0, delay: int = 0, moments: bool = False, draw: int = 0,
                   pooled_moment: bool = False, embeddings_every: int = 0,
                   early: tuple[int, int] = (0, 0)) -> RunResult:  # fmt: skip
    """The ceiling of parameter averaging: ``peers`` copies of our model, each with its own AdamW on its own
    windows (the swarm's batches), averaged after every optimizer step (``every``: every that many steps),
    in this process (no network, no waiting, no stale results). A swarm that averages every few steps, while
    it trains on, can only do worse. Every replica trains every expert, or with ``own_experts`` only its
    own ``experts.per_peer`` of them, as a swarm peer does (the others are frozen copies, taken from their
    trainers at every averaging); an expert is the mean of the replicas that trained it. A lossy ``codec``
    (``sync.codec``'s names) averages through it (``coded_average``), the dense weights through
    ``dense_codec`` if given. ``outer`` (alpha, momentum) applies each average through the swarm's outer
    optimizer (``outer_average``), as ``sync.sync_alpha`` and ``sync.outer_momentum`` do. With ``merge``, the
    merge warm-up (``sync.merge_*``) follows the averages that a swarm's rounds of the same index and step
    would merge (``merge_replicas``). ``experts_every`` (default ``every``) averages the experts, and so
    refreshes the copies of those with one trainer, on an interval of their own: ``every`` is then the dense
    weights' alone, as ``sync.refresh_every`` spaces a swarm's refresh rounds. ``delay``: each average lands
    that many steps after its snapshots, the steps taken meanwhile kept (``LateAverages``), as a swarm's
    rounds do while it trains on; the last step's average is synchronous, as its final agreement. Split
    intervals work with plain averaging, a codec or merges (each replica then merges only its own experts,
    its copies refreshed at the next experts' average), late averages with plain averaging only, and so do
    ``moments``, which average the AdamW moments too (``average_moments``), of every expert only. ``draw``: the
    peers' windows' draw (``peer_samplers``). ``pooled_moment``: each replica steps with ``PooledMomentAdamW`` on its
    batch's two halves, its second moment the pooled batch's (a pool of ``peers`` for the dense weights, of
    the holders for an expert). ``embeddings_every`` (default ``every``): the token embeddings and output
    head (``EMBEDDINGS``) are averaged on an interval of their own, ``every`` then being that of the rest of
    the dense weights (attention, norms, routers); plain averages only. ``early`` (every, until): the dense
    weights are averaged every ``early[0]`` steps up to step ``early[1]``, then every ``every`` (a schedule
    that spends more rounds while the learning rate is at its peak)."""
    from benchmarks.coded_average import CodedAverage
    from benchmarks.outer_average import OuterAverage
    from benchmarks.replica_rounds import (
        LateAverages,
        average_moments,
        average_replicas,
        merge_replicas,
        peer_samplers,
    )
    from swarm.data.run_dataset import open_dataset
    from swarm.model import MoETransformer
    from swarm.sync import merge_alpha_at, should_merge
    from swarm.sync.codecs import codec_named
    from swarm.train.optimizer import build_optimizer, set_lr
    from swarm.train.pooled_moment import clip_scale
    from swarm.train.schedule import lr_at

    experts, dense = codec_named(codec), codec_named(dense_codec or codec)
    lossless, experts_every = experts.lossless and dense.lossless, experts_every or every
    embeddings_every = embeddings_every or every
    split_embeddings = embeddings_every != every
    early_every, early_until = early
    if why := unmodelled(
        experts_every != every,
        delay,
        outer != (1.0, 0.0),
        merge,
        lossless,
        split_embeddings,
        early_every != 0,
    ):
        raise ValueError(why)
    if early_every and min(early_every, early_until) < 1:
        raise ValueError("early: EVERY and UNTIL must be at least 1")
    if moments and (
        own_experts
        or outer != (1.0, 0.0)
        or not lossless
        or delay
        or experts_every != every
        or split_embeddings
    ):
        raise ValueError("moments: plain, synchronous averages of every expert only")
    t0, t, ds, n_exp = time.monotonic(), cfg.train, open_dataset(cfg, progress=False), cfg.model.n_experts
    per = min(n_exp, cfg.experts.per_peer or n_exp) if own_experts else n_exp
    owned = [sorted({(i * per + j) % n_exp for j in range(per)}) for i in range(peers)]
    models, opts, samplers = [], [], peer_samplers(ds, cfg, peers, draw)
    for i in range(peers):
        m = MoETransformer(cfg.model, owned[i], cfg.experts.frozen_dtype)
        m.init_weights(t.seed)
        models.append(m.to(device))
        opts.append(
            build_optimizer(m, t)
            if not pooled_moment
            else pooled_moment_optimizer(m, t, peers, peers * per / n_exp)
        )
    averaging = None if lossless else CodedAverage(experts, models, owned, n_exp, dense)
    if outer != (1.0, 0.0):
        averaging = OuterAverage(owned, n_exp, *outer)
    late = LateAverages(owned, n_exp, delay) if delay else None

    def evaluate() -> float:
        return heldout_loss(
            hf_model_from(cfg, models[0].canonical_state_dict()).to(device), cfg, device=device
        )

    tokens, rounds, curve = 0, 0, [(0, evaluate())]
    for step in range(steps):
        for m, opt, sampler in zip(models, opts, samplers, strict=True):
            set_lr(opt, lr_at(step, t))
            batch = sampler.next_batch().to(device)
            if pooled_moment:
                half = batch.shape[0] // 2
                (m(batch[:half, :-1], targets=batch[:half, 1:]).loss / 2).backward()
                opt.mark_half()
                (m(batch[half:, :-1], targets=batch[half:, 1:]).loss / 2).backward()
                opt.step(grad_scale=clip_scale(m.trainable_parameters(), t.grad_clip))
            else:
                m(batch[:, :-1], targets=batch[:, 1:]).loss.backward()
                if t.grad_clip:
                    torch.nn.utils.clip_grad_norm_(m.trainable_parameters(), t.grad_clip)
                opt.step()
            opt.zero_grad(set_to_none=True)
        dense_due, experts_due, embeddings_due = (
            (step + 1) % n == 0 or step + 1 == steps for n in (every, experts_every, embeddings_every)
        )
        if early_every and step + 1 <= early_until:
            dense_due = embeddings_due = (step + 1) % early_every == 0 or dense_due
        if late and step + 1 < steps:
            if dense_due or experts_due:
                late.start(models, step + 1, dense=dense_due, experts=experts_due)
            late.land(models, step + 1)
        elif dense_due or experts_due or embeddings_due:  # (embeddings_due is dense_due unless split)
            if late:  # the last step: the rounds in flight land, then the final agreement
                late.land(models, step + 1, everything=True)
            if averaging:
                averaging(models, dense=dense_due, experts=experts_due)
            else:
                average_replicas(models, owned, n_exp, dense_due, experts_due, embeddings_due)
                if moments:
                    average_moments(opts)
            rounds += 1
            sc = cfg.sync
            if merge and should_merge(step + 1, rounds, sc.merge_warmup_steps, sc.merge_every):
                alpha = merge_alpha_at(step + 1, sc.merge_alpha, sc.merge_warmup_steps)
                merge_replicas(models, alpha, sc.merge_topk, owned if experts_every != every else None)
        tokens += peers * cfg.data.micro_batch * cfg.data.seq_len
        if (step + 1) % eval_every == 0 or step + 1 == steps:
            curve.append((tokens, evaluate()))
    name = ("every_step_spes" if own_experts else "every_step") + ("" if every == 1 else f"_every_{every}")
    name += f"_experts_every_{experts_every}" if experts_every != every else ""
    name += f"_embeddings_every_{embeddings_every}" if split_embeddings else ""
    name += f"_early_{early_every}_until_{early_until}" if early_every else ""
    name += f"_late_{delay}" if delay else ""
    if outer != (1.0, 0.0):
        name += f"_outer_{outer[0]:g}_{outer[1]:g}"
    elif averaging is not None:
        name += f"_{codec}" + (f"_dense_{dense.name}" if dense.name != codec else "")
    name += f"_merge_{cfg.sync.merge_alpha:g}" if merge else ""
    name += "_moments" if moments else ""
    name += "_pooled_moment" if pooled_moment else ""
    return RunResult(name, curve[-1][1], tokens, time.monotonic() - t0, curve=curve)


def pooled_moment_optimizer(model, t, dense_pool: float, expert_pool: float):
    """``build_optimizer`` with ``train.pooled_moment`` on: the dense groups' pool ``dense_pool``, the experts'
    ``expert_pool``."""
    from dataclasses import replace

    from swarm.train.optimizer import build_optimizer

    opt = build_optimizer(model, replace(t, pooled_moment=True))
    opt.set_pools(dense_pool, expert_pool)
    return opt
