"""The last round: every peer of a run that stops takes one synchronous round, then settles its replicas.

    records = take_last_round(sync, model, report)    # SwarmSync.last_round calls this

The peer says it is finishing (a pending orphan claim is void), waits for (or abandons) the round in flight,
and starts a round marked last: peers given the same stop time meet at a shared moment (``last_round_at``),
and an ordinary round never mixes with a last one. Then the final agreement (``final_agreement``) makes
every replica of the dense weights and of each expert the same, even where that round failed on one holder,
and only then does each holder mark its copies final and every peer fetch the final copies of the experts
it does not hold. The peer keeps serving until the others are done too, within a bound.
"""

from __future__ import annotations

import time

import torch

from swarm.model import MoETransformer
from swarm.net.expert_tensors import dense_tensors, expert_tensors, overwrite
from swarm.net.final_agreement import FinalItem, agree_on_final_copies, finishing_holders
from swarm.net.group_layout import (
    DENSE,
    GroupSpec,
    expert_item,
    item_expert,
    pack,
    served_dense,
    served_items,
)
from swarm.net.round_consensus import REL_TOLERANCE
from swarm.net.served_prints import served_prints
from swarm.train.round_record import RoundRecord
from swarm.train.sync_hook import StepReport


def take_last_round(sync, model: MoETransformer, report: StepReport) -> list[RoundRecord]:
    """See the module docstring. ``sync``: the peer's ``SwarmSync``."""
    # "finishing" goes out before the wait for the round in flight: a peer that ends its last round before
    # we end ours must count us among the holders whose final digests it waits for
    sync.members.set_state("finishing")
    sync.wait_for_round()
    records = sync.apply_finished(model)
    sync.leaving = True
    scheduled = None
    if sync.last_round_at is not None:  # every peer of the run meets at the same moment for the last round
        scheduled = max(sync.last_round_at, time.time() + sync.timing.matchmaking_s)
    sync.start_round(model, report.step, scheduled)
    sync.wait_for_round()
    records += sync.apply_finished(model)
    adopted, unsettled = settle_replicas(sync, model)
    downloaded, failures = fetch_final_copies(sync, model)
    if records:
        rec = records[-1]
        rec.final_adopted, rec.final_unsettled = adopted, unsettled
        rec.final_downloaded, rec.download_failures = downloaded, rec.download_failures + failures
        rec.applied = rec.applied or bool(adopted) or bool(downloaded)
    # keep serving our experts until the others are done too: they may still be settling their replicas
    # (up to the final agreement's wait), then downloading our final copies (up to a round timeout)
    sync.members.set_state("done")
    sync.members.wait_until_others_done(sync.timing.final_wait_s + sync.timing.round_s)
    return records


def settle_replicas(sync, model: MoETransformer) -> tuple[list[str], list[str]]:
    """The final agreement over the dense weights and our experts, among the other finishing holders."""
    ctx, transport = sync.ctx, sync.transport
    sync.members.refresh()
    peers = sync.members.view.peers
    live = {DENSE: dense_tensors(model)} | {
        expert_item(e): expert_tensors(model, e) for e in model.local_experts
    }
    items = {name: FinalItem(ts, finishing_holders(peers, ctx.me, name)) for name, ts in live.items()}
    dense_spec = GroupSpec(f"{ctx.run_id}_dense", (DENSE,))
    step, index = sync.members.view.step_of(ctx.me), sync.round_index

    def fetch(peer: str, name: str) -> list[torch.Tensor] | None:
        source = dense_spec.name if name == DENSE else ctx.server.group.name
        served = transport.fetch(peer, source, timeout=ctx.timing.final_agreement_s)
        if served is None:
            return None
        if name == DENSE:
            return served_dense(dense_spec, served.meta, served.tensors, len(live[DENSE]))
        return served_items(served.meta, served.tensors, len(expert_tensors(model, 0))).get(name)

    def serve(name: str, tensors: list[torch.Tensor]) -> None:
        if name == DENSE:
            copies = {e: expert_tensors(model, e) for e in range(sync.n_experts)}
            meta = {"items": [DENSE], "step": step, "round": index, "last": True}
            meta |= served_prints(tensors, copies, step, sync.copy_steps)
            group = ctx.groups.get(dense_spec, {DENSE: tensors})
            try:
                group.serve(list(pack(dense_spec, {DENSE: tensors}, {DENSE: 1.0})), meta)
            except TimeoutError:  # an all-reduce that overran still holds the buffers: not served
                pass
        elif item_expert(name) in model.local_experts:
            ctx.server.update({name: tensors}, step, final=False)

    def still_coming(peer: str) -> bool:
        """A holder that withdrew, or has published no heartbeat for a record's lifetime, sends no digest."""
        view = sync.members.view  # the heartbeat thread reads the swarm every period
        return peer in view.peers and view.silent_for(peer) <= ctx.timing.record_ttl_s

    settled = agree_on_final_copies(
        ctx.store, ctx.run_id, ctx.me, items, fetch, serve, ctx.timing.final_agreement_s,
        sync.sc.max_rel_distance, ctx.timing.final_window_s, ctx.timing.final_wait_s,
        tolerance=0.0 if not ctx.payloads.lossless else REL_TOLERANCE, still_coming=still_coming,
    )  # fmt: skip
    # what every non-holder must end with: our copies as settled
    ctx.server.update({e: ts for e, ts in live.items() if e != DENSE}, step, final=True)
    return settled


def fetch_final_copies(sync, model: MoETransformer) -> tuple[list[int], list[str]]:
    """Non-local experts as their holders settled them (within a round timeout): (fetched, failures)."""
    ctx = sync.ctx
    view = sync.members.view
    frozen = {e: expert_tensors(model, e) for e in range(sync.n_experts) if e not in model.local_experts}
    holders = {e: [(p, view.step_of(p)) for p in view.holders.get(e, ()) if p != ctx.me] for e in frozen}
    deadline = time.monotonic() + ctx.timing.round_s
    got, rejected, failures = ctx.downloads.fetch(holders, frozen, view.step_of(ctx.me), True, deadline)
    failures += [f"expert{e}: no holder in view for its final copy" for e, hs in holders.items() if not hs]
    with sync.copies.lock:
        for e, tensors in got.items():
            overwrite(frozen[e], tensors)
    sync.took_copies({e: ctx.downloads.steps.get(e, view.step_of(ctx.me)) for e in got})
    return sorted(got), rejected + failures
