"""Refreshing a non-local expert from one of its holders during a round.

    downloads = ExpertDownloads(dht, run_id, download_s=30.0, max_rel_distance=4.0)
    tensors = downloads.fetch(e, holders, mine, step=100, final=False, deadline=t, rejected=rec["rejected"])
    rec["download_failures"] = downloads.take_failures()

``holders`` are (peer id, its last reported step) pairs. A holder still in the same round is asked again
until the deadline: its result is the copy worth having; a holder behind us is taken as it is. Every copy
passes the tensor checks against ours before it is returned, and stays fp16 as it travelled.
"""

from __future__ import annotations

import time

import hivemind
import torch

from swarm.net.averaging import download_state
from swarm.sync import RejectedTensor, check_tensors

RETRY_S = 0.5
MAX_EMPTY_ANSWERS = 5  # an averager answers with no state until it shares one; an ordinary round gives up


class ExpertDownloads:
    """See the module docstring."""

    def __init__(self, dht: hivemind.DHT, run_id: str, download_s: float, max_rel_distance: float) -> None:
        self.dht, self.run_id = dht, run_id
        self.download_s, self.max_rel_distance = download_s, max_rel_distance
        self._failures: list[str] = []

    def take_failures(self) -> list[str]:
        failures, self._failures = self._failures, []
        return failures

    def fetch(
        self,
        e: int,
        holders: list[tuple[str, int]],
        mine: list[torch.Tensor],
        step: int,
        final: bool,
        deadline: float,
        rejected: list[str],
    ) -> list[torch.Tensor] | None:
        """Expert ``e`` from the first of (at most two of) ``holders`` that serves a valid fresh copy."""
        for peer, peer_step in sorted(holders, key=lambda h: -h[1])[:2]:
            got = self._fresh_state(peer, peer_step, e, step, final, deadline)
            if got is None:
                continue  # holder gone, or it has not finished a round yet
            # fp16 on the wire, but hivemind restores the sender's dtype: keep the fp16 values (no loss)
            tensors = [t.half() if t.dtype == torch.float32 else t for t in got[1]]
            try:
                check_tensors(f"expert{e}", tensors, mine, self.max_rel_distance)
            except RejectedTensor as err:
                rejected.append(str(err))
                continue
            return tensors
        return None

    def _fresh_state(self, peer: str, peer_step: int, e: int, step: int, final: bool, deadline: float):
        empty_answers = 0
        while True:
            left = deadline - time.monotonic()
            if left <= RETRY_S:
                return None
            prefix = f"{self.run_id}_expert{e}"
            got = download_state(self.dht, peer, prefix, timeout=min(left, self.download_s))
            if got is None:
                self._failures.append(f"expert{e} from {peer[-8:]}: no answer")
                return None
            if not isinstance(got[0], dict) or not isinstance(got[0].get("step"), int):
                # not sharing a state yet: ask again shortly (for a last round until the deadline: that copy
                # is the one every peer must end with)
                empty_answers += 1
                if empty_answers >= MAX_EMPTY_ANSWERS and not final:
                    why = f"no finished round (meta {str(got[0])[:60]})"
                    self._failures.append(f"expert{e} from {peer[-8:]}: {why}")
                    return None
                time.sleep(RETRY_S)
                continue
            fresh = bool(got[0].get("final")) if final else got[0]["step"] >= step
            if fresh or peer_step < step:
                return got
            time.sleep(RETRY_S)
