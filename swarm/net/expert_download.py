"""Refreshing non-local experts from their holders during a round.

    downloads = ExpertDownloads(transport, server_name, download_s=30.0, max_rel_distance=4.0, lr=3e-3)
    got, rejected, failures = downloads.fetch({5: [(peer, step)], ...}, mine, step=100, final=False, deadline=t)

Each holder serves its local experts under one name (``<run>_experts``): one request brings every expert a
holder has that we want. The freshest holder of each expert is asked first (a holder that served us nothing
the time before, last), the next one for what it could not give; holders are asked at once (a thread each),
so a round waits for the slowest, not for their sum. In an ordinary round a holder still in the same round
is asked again until the deadline (its result is the copy worth having): once it has shown an older copy,
each ask for the copy is held by the holder until it serves a new one, so the copy comes when it is served,
not at the next poll. A holder behind us is taken as it is, and so is one that has stopped training (its
last round is next, and it waits for ours). After the last round only the holder's final
copy will do (every peer must end with it), up to the deadline; from a holder behind us, only a copy newer
than the one we hold (``held``), for a few seconds. Every copy passes the tensor checks against ours, and
stays fp16 as it travelled. Copies of one fetch must also move alike: one whose change since our copy is far
above the median change of the fetch's copies (``outlying_changes``), or whose norm is far off ours or which
points away from ours (``copy_doubt``: a holder that negated, zeroed or scaled what it serves) is refused,
and asked of the next holder.

With a lossy codec (``deltas_name``: the holders' ``ExpertServer`` serves changes), an expert whose copy came
from a holder is refreshed from that holder's change against it, encoded by the codec, when the change
fits our copy exactly (by hash; the result is checked by hash too); anything else is a whole copy.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from swarm.net.expert_server import copy_hash
from swarm.net.expert_tensors import on_this_stream
from swarm.net.group_layout import expert_item, served_items
from swarm.net.served_steps import Fresh, fits_any, served_steps
from swarm.net.transport import GroupTransport, Served
from swarm.sync import CopyComparison, RejectedTensor, outlying_changes
from swarm.sync.codecs import Codec
from swarm.sync.copy_prints import copy_doubt, copy_print, norm_doubt, norm_factor, rms

RETRY_S = 0.5
# asking again for a copy that is not fresh yet: soon at first, then less often up to RETRY_S. On GPU peers
# whose rounds start in the same slot, a holder serves its new copy a training step (and an encoding) after
# we first ask; a fixed RETRY_S left the link idle for up to half a second of every refresh round
FIRST_RETRY_S = 0.05
# an ask for a copy that is not fresh yet is held by the holder for up to this long, and answered as soon as
# it serves a new one (``GroupTransport.fetch``'s ``hold_s``). Polling alone, H100 peers' downloads found
# their holders' new copies 0.15 s (median) after they first asked, the link mostly idle meanwhile
HOLD_S = 1.0
ATTEMPTS = 3  # holders asked in turn for one expert, at most
MAX_EMPTY_ANSWERS = 5  # a holder serves nothing until its first round; an ordinary round gives up
# a holder behind us in steps: how long to wait for a copy newer than ours. With rounds on the wall clock
# every peer starts its round at the same slot, but a holder serves its new copy only once its own round
# starts (up to a training step later); downloads begin with our round, so its previous copy, which we
# already hold, is what it serves at first
BEHIND_PATIENCE_S = 5.0


class ExpertDownloads:
    """See the module docstring."""

    def __init__(
        self,
        transport: GroupTransport,
        server_name: str,
        download_s: float,
        max_rel_distance: float,
        changes: tuple[str, Codec] | None = None,
        lr: float | None = None,
    ) -> None:
        """``lr``: the peers' peak learning rate, which bounds how far a copy newer than ours may have
        grown (``norm_factor``; None: not at all)."""
        self.transport, self.server_name, self.lr = transport, server_name, lr
        self.deltas_name, self.codec = changes if changes else (None, None)
        self.download_s, self.max_rel_distance = download_s, max_rel_distance
        self.received = 0  # bytes that arrived during the last ``fetch``, as they travelled
        self.waited_s = 0.0  # of the last ``fetch``: the longest any holder's copy was waited for to be fresh
        self.steps: dict[int, int] = {}  # of the copies the last ``fetch`` returned: the step each is from
        self._source: dict[int, str] = {}  # expert -> the holder our copy came from (whose changes fit it)
        self._received_lock = threading.Lock()  # holders are asked from threads of their own
        # expert -> (the swarm's print, its step), while our copy is no reference for it (``judge_by_prints``)
        self._print_refs: dict[int, tuple[torch.Tensor, int | None]] = {}
        self._misses: dict[str, int] = {}  # peer -> fetches in a row in which it served nothing asked of it
        self._held: Mapping[int, int] = {}  # of the current fetch: the step of each copy we hold
        self._lagged: threading.Event | None = None  # of the current fetch: ``fetch``'s ``lagged``
        self._stopped: Callable[[str], bool] = lambda peer: False  # of the current fetch: ``stopped``
        self._patience_end = float("inf")  # of the current fetch: ``patience_end``
        # the step of each copy we hold, as far as we know (kept between fetches: a final fetch is told none),
        # and of the current fetch the RMS value of each: how far a new copy may have grown (``norm_factor``)
        self._copy_steps: dict[int, int] = {}
        self._rms: dict[int, float] = {}

    def judge_by_prints(self, references: Mapping[int, tuple[torch.Tensor, int | None]]) -> None:
        """Judge the next copies of these experts by the swarm's prints and their steps (``catch_up``)
        instead of by our copy, which is still the initialisation: no reference for a trained expert."""
        self._print_refs = dict(references)

    def _norm_factor(self, e: int, new_step: int | None) -> float:
        """How far a copy of expert ``e`` from ``new_step`` may be off ours in norm (``norm_factor``)."""
        ours = self._copy_steps.get(e)
        return norm_factor(
            None if ours is None or new_step is None else new_step - ours, self.lr, self._rms[e]
        )

    def _max_distance(self, e: int, new_step: int | None) -> float:
        """``check_tensors``' bound for that copy: never tighter than the norm bound implies (the distance
        between copies of norms 1 and f is up to f + 1)."""
        return max(self.max_rel_distance, self._norm_factor(e, new_step) + 1.0)

    def _doubt(self, e: int, tensors: list[torch.Tensor], compared: CopyComparison, new_step: int) -> str:
        if e in self._print_refs:
            ref, ref_step = self._print_refs[e]
            apart = None if ref_step is None else new_step - ref_step
            return copy_doubt([copy_print(tensors)], [ref], factor=norm_factor(apart, self.lr, rms([ref])))
        factor = self._norm_factor(e, new_step)
        return norm_doubt(compared.received_norm, compared.norm, compared.dot, factor=factor)

    def fetch(
        self,
        holders: Mapping[int, Sequence[tuple[str, int]]],
        mine: Mapping[int, list[torch.Tensor]],
        step: int,
        final: bool,
        deadline: float,
        held: Mapping[int, int] | None = None,
        lagged: threading.Event | None = None,
        stopped: Callable[[str], bool] | None = None,
        patience_end: float | None = None,
    ) -> tuple[dict[int, list[torch.Tensor]], list[str], list[str]]:
        """({expert: tensors}, rejected, failures) for the experts in ``holders`` (expert -> (peer, its
        last reported step) pairs). ``final``: only a holder's final copy (settled after its last round).
        ``held``: the step of each copy we hold (a holder behind us serves nothing newer until its round).
        ``lagged`` (``sync.lagged_refresh``: a holder serves its last round's copies from its round's
        start): every holder is asked as one behind us is, for a copy newer than ours, until the event is
        set (our groups are done: a holder that has none by then has none this round). ``stopped(peer)``:
        whether a holder has stopped training (its last round is next); from then on it is asked as one
        behind us is, once more and without waiting. ``patience_end`` (monotonic): a holder behind us is
        waited for until then at most (the next slot's meeting, with rounds on the wall clock)."""
        got: dict[int, list[torch.Tensor]] = {}
        rejected: list[str] = []
        failures: list[str] = []
        self.received, self.steps, self._held, self.waited_s = 0, {}, dict(held or {}), 0.0
        self._lagged, self._stopped = lagged, stopped or (lambda peer: False)
        self._patience_end = float("inf") if patience_end is None else patience_end
        self._copy_steps |= self._held
        self._rms = {e: rms(mine[e]) for e in holders if e in mine}
        # the freshest holders first, but those that gave us nothing before last: a member that claims
        # experts it does not serve (and a huge step) is asked once, then after the holders that answer
        ranked = {
            e: sorted(hs, key=lambda h: (self._misses.get(h[0], 0) > 0, -h[1]))[:ATTEMPTS]
            for e, hs in holders.items()
            if hs
        }
        changes: dict[int, float] = {}  # of the copies taken so far: what a second holder's are judged by
        for attempt in range(ATTEMPTS):
            by_peer: dict[tuple[str, int], list[int]] = {}
            for e, hs in ranked.items():
                if e not in got and attempt < len(hs):
                    by_peer.setdefault(hs[attempt], []).append(e)
            if not by_peer:
                break
            ask = on_this_stream(self._from_holder)  # our copies may be on a GPU: read on our stream
            with ThreadPoolExecutor(len(by_peer), thread_name_prefix="swarm-download") as pool:
                asked = [
                    pool.submit(ask, peer, peer_step, wanted, mine, step, final, deadline)
                    for (peer, peer_step), wanted in by_peer.items()
                ]
                answers = [(peer, a.result()) for (peer, _), a in zip(by_peer, asked, strict=True)]
            # an expert judged by prints has no copy of ours to have changed from
            new = {
                e: a.compared[e].relative_change
                for _, a in answers
                for e in a.copies
                if e not in self._print_refs
            }
            outliers, median = outlying_changes(changes | new)
            for peer, answer in answers:
                # a holder that served none of what it was asked for is tried last next time
                answered = bool(answer.copies or answer.rejected)
                self._misses[peer] = 0 if answered else self._misses.get(peer, 0) + 1
                for e in sorted(answer.copies):
                    why = self._doubt(e, answer.copies[e], answer.compared[e], answer.steps.get(e, step))
                    if e in outliers:
                        why = f"changed {new[e]:.3g} of its norm, the fetch's median copy {median:.3g}"
                    if why:
                        del answer.copies[e]
                        rejected.append(f"expert{e} from {peer[-8:]}: {why}")
                got |= answer.copies
                self.steps |= {e: answer.steps.get(e, step) for e in answer.copies}
                self._copy_steps |= {e: self.steps[e] for e in answer.copies}
                self._source |= dict.fromkeys(answer.copies, peer)
                for e in answer.copies:
                    self._print_refs.pop(e, None)
                rejected += answer.rejected
                failures += answer.failures
            changes |= {e: c for e, c in new.items() if e in got}
        return got, rejected, failures

    def _from_holder(
        self, peer: str, peer_step: int, wanted: list[int], mine, step: int, final: bool, deadline: float
    ) -> _HolderAnswer:
        answer = _HolderAnswer()
        if self.deltas_name and not final:  # the changes since our copy, where they fit it
            # a copy of unknown source may still fit (every peer starts from the same initialisation)
            fits = [e for e in wanted if self._source.get(e, peer) == peer]
            changed = self._changes(peer, peer_step, fits, mine, step, deadline, answer.steps) if fits else {}
            answer.accept(changed, mine, self._max_distance)
            wanted = [e for e in wanted if e not in answer.copies]
            if not wanted:
                return answer
        per_item = len(mine[wanted[0]])
        served = self._fresh(peer, peer_step, wanted, per_item, step, final, deadline, answer.failures)
        if served is None:
            return answer
        items = served_items(served.meta, served.tensors, per_item)
        steps = served_steps(served.meta)
        copies = {}
        for e in wanted:
            tensors = items.get(expert_item(e))
            if tensors is None:  # what it served instead says why (a copy cut short, other items)
                got = f"{len(served.tensors)} tensors for items {str(served.meta.get('items'))[:80]}"
                answer.failures.append(f"expert{e} from {peer[-8:]}: not served ({got})")
                continue
            # fp16 on the wire, but the sender's dtype comes back: keep the fp16 values (no loss)
            copies[e] = [t.half() if t.dtype == torch.float32 else t for t in tensors]
            answer.steps[e] = steps[expert_item(e)][0] if expert_item(e) in steps else step
        answer.accept(copies, mine, self._max_distance)
        return answer

    def _changes(
        self, peer: str, peer_step: int, wanted: list[int], mine, step: int, deadline: float, steps: dict
    ) -> dict[int, list[torch.Tensor]]:
        """The holder's new copies of ``wanted``, rebuilt from its changes against the copies we hold: only
        where its base is exactly our copy, and the result exactly its new copy (both by hash). ``steps``
        gets the step each new copy is from."""
        # patience as for copies: a holder serves no change until its first round after the one that made
        # our copy (downloads start with our round, and its round may start a moment later)
        # our copies' hashes go with the ask: changes that fit none of them do not travel
        ours = {expert_item(e): copy_hash(mine[e]) for e in wanted}
        per_item, name = len(mine[wanted[0]]), self.deltas_name
        served = self._fresh(
            peer, peer_step, wanted, per_item, step, False, deadline, [], name, tuple(ours.items())
        )
        if served is None:
            return {}
        meta = served.meta
        items = served_items(meta, served.tensors, per_item)
        names, bases, hashes = meta.get("items"), meta.get("base"), meta.get("hash")
        if not all(isinstance(v, list) for v in (names, bases, hashes)) or not (
            len(bases) == len(hashes) == len(names)
        ):
            return {}  # a holder's metadata may be anything
        out = {}
        for e in wanted:
            k = names.index(expert_item(e)) if expert_item(e) in names else None
            if k is None or expert_item(e) not in items or ours[expert_item(e)] != bases[k]:
                continue
            base = [t.detach().to("cpu", torch.float16) for t in mine[e]]
            new = [(b.float() + c.float()).half() for b, c in zip(base, items[expert_item(e)], strict=True)]
            if copy_hash(new) == hashes[k]:
                out[e] = new
                steps[e] = served_steps(meta).get(expert_item(e), (step, False))[0]
        return out

    def _fresh(
        self,
        peer: str,
        peer_step: int,
        wanted: list[int],
        per_item: int,
        step: int,
        final: bool,
        deadline: float,
        failures: list[str],
        name: str | None = None,
        bases: tuple[tuple[str, str], ...] = (),
        patience: int = MAX_EMPTY_ANSWERS,
    ) -> Served | None:
        """The holder's copies (or, ``bases`` given, its changes against copies of these hashes) once fresh;
        the latest it served, or None, when it gives up."""
        empty_answers, label, latest = 0, f"experts {wanted} from {peer[-8:]}", None
        retry, waited, listed = FIRST_RETRY_S, 0.0, False
        items = tuple(expert_item(e) for e in wanted)
        # fresh: from this round; from a holder behind us, newer than ours (None: any copy)
        behind = peer_step < step or self._lagged is not None
        have = [self._held[e] for e in wanted if e in self._held]
        min_step = step if not behind else (min(have) + 1 if have else None)
        newer_only = behind and bool(have)  # nothing newer within the patience: we keep ours, no failure
        # not into the next slot: a round that got the copy served at its start left the next one a slot to wait
        behind_until = min(time.monotonic() + BEHIND_PATIENCE_S, self._patience_end)
        give_up = min(deadline, behind_until) if newer_only else deadline
        groups_done = self._lagged if newer_only else None  # a lagged refresh asks no longer than that
        stopped = False
        while True:
            if not final and not stopped and self._stopped(peer):
                # a holder that stopped training serves nothing fresher before its last round, and that
                # round waits for ours to end: what it serves now will do if it is newer than ours
                stopped, newer_only = True, bool(have)
                min_step = min(have) + 1 if have else None
                give_up = min(give_up, time.monotonic() + RETRY_S)  # one more ask, not held
            left = deadline - time.monotonic()
            lag_over = groups_done is not None and groups_done.is_set()
            if left <= RETRY_S or time.monotonic() >= give_up or lag_over:
                if latest is None and not newer_only:
                    failures.append(f"{label}: no fresh copy before the deadline")
                elif final:  # its newest copy is better than ours, but not what its other holders end with
                    failures.append(f"{label}: no final copy before the deadline; took its newest")
                return latest
            # only a copy worth having travels; after the last round, the first answer comes whole (the
            # newest copy, kept in case the holder never settles), then only a final one
            fresh = Fresh(items, min_step, final, bases) if not final or latest else None
            # held once the holder has shown it serves these, only older (a holder that serves none of them
            # may never: a changes server before its second round), not past our patience, and not in a
            # lagged refresh (which asks no longer than our groups take)
            hold = (
                max(0.0, min(HOLD_S, give_up - time.monotonic() - RETRY_S))
                if listed and not groups_done
                else 0.0
            )
            asked = time.monotonic()
            served = self.transport.fetch(
                peer, name or self.server_name, min(left, self.download_s), fresh, hold
            )
            if served is not None:  # every answer counts: tensors travel whole, or not at all (``fresh``)
                encoded = name is not None and name == self.deltas_name
                moved = sum(
                    self.codec.wire_bytes(t.numel()) if encoded else t.numel() * t.element_size()
                    for t in served.tensors
                )
                with self._received_lock:
                    self.received += moved
            if served is None:
                failures.append(f"{label}: no answer")
                return latest
            steps = served_steps(served.meta)
            listed = all(expert_item(e) in steps for e in wanted)
            if not listed:
                # not serving these (yet): ask again shortly (for a final copy until the deadline: that copy
                # is the one every peer must end with)
                empty_answers += 1
                if empty_answers >= patience and not final:
                    failures.append(f"{label}: not served (meta {str(served.meta)[:60]})")
                    return None
                time.sleep(RETRY_S)
                continue
            copies = [steps[expert_item(e)] for e in wanted]
            # a copy whose tensors do not split into its items (cut short on the way) is asked for again
            whole = set(items) <= served_items(served.meta, served.tensors, per_item).keys()
            if final:  # every peer must end with the holder's final copy, whatever the steps: wait for it
                if whole and all(is_final for _, is_final in copies):
                    return served
                latest = served if whole else latest
            elif min_step is None or min(s for s, _ in copies) >= min_step:
                if whole:
                    with self._received_lock:  # the hold before it came counts as waiting for it
                        self.waited_s = max(self.waited_s, waited + served.held_s)
                    return served  # fresh from this round, or from a holder behind us and newer than ours
                if not fits_any(served.meta, bases):
                    return None  # fresh, but no change against a copy of ours: a whole copy will do
            # asked again no sooner than ``retry`` after the last ask (a held ask has mostly waited that long
            # already; a holder that answers held asks at once is polled), but at once after an ask that was
            # not held when the next one is (the holder does the waiting)
            held_next = not groups_done and give_up - time.monotonic() - RETRY_S > FIRST_RETRY_S
            pause = 0.0 if held_next and not hold else max(0.0, retry - (time.monotonic() - asked))
            if groups_done is not None:
                groups_done.wait(pause)  # woken when our groups are done
            else:
                time.sleep(pause)
            waited, retry = waited + time.monotonic() - asked, min(RETRY_S, 2 * retry)
            with self._received_lock:
                self.waited_s = max(self.waited_s, waited)


@dataclass
class _HolderAnswer:
    """What one holder gave: checked copies, and why the rest did not come."""

    copies: dict[int, list[torch.Tensor]] = field(default_factory=dict)
    compared: dict[int, CopyComparison] = field(default_factory=dict)  # each copy against ours
    steps: dict[int, int] = field(default_factory=dict)  # the step each copy is from, as its holder says
    rejected: list[str] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)

    def accept(
        self, copies: Mapping[int, list[torch.Tensor]], mine, max_distance: Callable[[int, int | None], float]
    ) -> None:
        """Keep the copies that pass ``check_tensors``' checks within ``max_distance(expert, its step)``."""
        for e, tensors in copies.items():
            try:
                compared = CopyComparison.of(f"expert{e}", tensors, mine[e])
                compared.check(max_distance(e, self.steps.get(e)))
            except RejectedTensor as err:
                self.rejected.append(str(err))
                continue
            self.copies[e], self.compared[e] = tensors, compared
