"""Refreshing non-local experts from their holders during a round.

    downloads = ExpertDownloads(transport, server_name, download_s=30.0, max_rel_distance=4.0)
    got, rejected, failures = downloads.fetch({5: [(peer, step)], ...}, mine, step=100, final=False, deadline=t)

Each holder serves its local experts under one name (``<run>_experts``): one request brings every expert a
holder has that we want. The freshest holder of each expert is asked first, a second holder for what the
first could not give. In an ordinary round a holder still in the same round is asked again until the
deadline (its result is the copy worth having), and a holder behind us is taken as it is. After the last
round only the holder's final copy will do (every peer must end with it), up to the deadline. Every copy passes
the tensor checks against ours, and stays fp16 as it travelled.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping, Sequence

import torch

from swarm.net.group_layout import expert_item, item_expert, served_items
from swarm.net.transport import Group, GroupTransport, Served
from swarm.sync import RejectedTensor, check_tensors

RETRY_S = 0.5
MAX_EMPTY_ANSWERS = 5  # a holder serves nothing until its first round; an ordinary round gives up


class ExpertDownloads:
    """See the module docstring."""

    def __init__(
        self, transport: GroupTransport, server_name: str, download_s: float, max_rel_distance: float
    ) -> None:
        self.transport, self.server_name = transport, server_name
        self.download_s, self.max_rel_distance = download_s, max_rel_distance

    def fetch(
        self,
        holders: Mapping[int, Sequence[tuple[str, int]]],
        mine: Mapping[int, list[torch.Tensor]],
        step: int,
        final: bool,
        deadline: float,
    ) -> tuple[dict[int, list[torch.Tensor]], list[str], list[str]]:
        """({expert: tensors}, rejected, failures) for the experts in ``holders`` (expert -> (peer, its
        last reported step) pairs). ``final``: only a holder's final copy (settled after its last round)."""
        got: dict[int, list[torch.Tensor]] = {}
        rejected: list[str] = []
        failures: list[str] = []
        ranked = {e: sorted(hs, key=lambda h: -h[1])[:2] for e, hs in holders.items() if hs}
        for attempt in range(2):
            by_peer: dict[tuple[str, int], list[int]] = {}
            for e, hs in ranked.items():
                if e not in got and attempt < len(hs):
                    by_peer.setdefault(hs[attempt], []).append(e)
            for (peer, peer_step), wanted in by_peer.items():
                served = self._fresh(peer, peer_step, wanted, step, final, deadline, failures)
                if served is None:
                    continue
                items = served_items(served.meta, served.tensors, len(mine[wanted[0]]))
                for e in wanted:
                    tensors = items.get(expert_item(e))
                    if tensors is None:
                        failures.append(f"expert{e} from {peer[-8:]}: not served")
                        continue
                    # fp16 on the wire, but the sender's dtype comes back: keep the fp16 values (no loss)
                    tensors = [t.half() if t.dtype == torch.float32 else t for t in tensors]
                    try:
                        check_tensors(f"expert{e}", tensors, mine[e], self.max_rel_distance)
                    except RejectedTensor as err:
                        rejected.append(str(err))
                        continue
                    got[e] = tensors
        return got, rejected, failures

    def _fresh(
        self,
        peer: str,
        peer_step: int,
        wanted: list[int],
        step: int,
        final: bool,
        deadline: float,
        failures: list[str],
    ) -> Served | None:
        empty_answers, label, latest = 0, f"experts {wanted} from {peer[-8:]}", None
        while True:
            left = deadline - time.monotonic()
            if left <= RETRY_S:
                if latest is None:
                    failures.append(f"{label}: no fresh copy before the deadline")
                return latest  # the newest copy it saw, if it never got a final one
            served = self.transport.fetch(peer, self.server_name, timeout=min(left, self.download_s))
            if served is None:
                failures.append(f"{label}: no answer")
                return latest
            steps = served_steps(served.meta)
            if not all(expert_item(e) in steps for e in wanted):
                # not serving these (yet): ask again shortly (for a final copy until the deadline: that copy
                # is the one every peer must end with)
                empty_answers += 1
                if empty_answers >= MAX_EMPTY_ANSWERS and not final:
                    failures.append(f"{label}: not served (meta {str(served.meta)[:60]})")
                    return None
                time.sleep(RETRY_S)
                continue
            copies = [steps[expert_item(e)] for e in wanted]
            if final:  # every peer must end with the holder's final copy, whatever the steps: wait for it
                if all(is_final for _, is_final in copies):
                    return served
                latest = served
            elif min(s for s, _ in copies) >= step or peer_step < step:
                return served  # fresh from this round, or from a holder behind us (taken as it is)
            time.sleep(RETRY_S)


def served_steps(meta: Mapping) -> dict[str, tuple[int, bool]]:
    """{item: (step, final)} of what a holder serves; {} if its metadata is malformed."""
    items, steps, final = meta.get("items"), meta.get("steps"), meta.get("final")
    ok = isinstance(items, list) and isinstance(steps, list) and isinstance(final, list)
    if not ok or not len(items) == len(steps) == len(final):
        return {}
    return {
        i: (s, bool(f))
        for i, s, f in zip(items, steps, final, strict=True)
        if isinstance(i, str) and isinstance(s, int) and not isinstance(s, bool)
    }


class ExpertServer:
    """What this peer serves to downloaders under one name: an fp16 copy of each local expert, with the
    step it is from and whether it is final (settled after the last round). Copies are replaced whole (a
    download never sees half of an update).

        server = ExpertServer(transport.open_server(f"{run}_experts"))
        server.update({"expert3": tensors}, step=100, final=False)
        server.keep(["expert3", "expert5"])    # after an expert switch
    """

    def __init__(self, group: Group) -> None:
        self.group = group
        self._copies: dict[str, tuple[list[torch.Tensor], int, bool]] = {}
        self._lock = threading.Lock()  # the round thread updates, the training thread keeps

    def update(self, items: Mapping[str, Sequence[torch.Tensor]], step: int, final: bool) -> None:
        fp16 = {i: [t.detach().to("cpu", torch.float16, copy=True) for t in ts] for i, ts in items.items()}
        with self._lock:
            self._copies.update({i: (ts, step, final) for i, ts in fp16.items()})
            self._publish()

    def keep(self, items: Sequence[str]) -> None:
        with self._lock:
            self._copies = {i: c for i, c in self._copies.items() if i in items}
            self._publish()

    def _publish(self) -> None:
        names = sorted(self._copies, key=item_expert)
        meta = {
            "items": names,
            "steps": [self._copies[i][1] for i in names],
            "final": [self._copies[i][2] for i in names],
        }
        self.group.serve([t for i in names for t in self._copies[i][0]], meta)
