"""What a holder serves of its local experts: fp16 copies, and with a lossy codec the change since the copy
it served before, for downloaders that hold that copy.

    server = ExpertServer(transport.open_server(f"{run}_experts"))                    # copies only
    server = ExpertServer(transport.open_server(f"{run}_experts"),
                          transport.open_server(f"{run}_expert_deltas", codec), codec)  # and changes
    server.update({"expert3": tensors}, step=100, final=False)
    server.keep(["expert3", "expert5"])    # after an expert switch

Each copy carries the step it is from and whether it is final (settled after the last round). With deltas,
the copies form a chain that a downloader can follow exactly: copy_k = fp16(copy_{k-1} + decoded change),
where the change is the expert's new value minus copy_{k-1} and travels encoded by the codec; each copy is
served with a hash of itself and of the copy it extends, so a downloader applies a change only to the very
copy it was computed against, and checks the result. Because every change is taken against the previous
copy, not against the previous true value, the codec's error never accumulates along the chain. Final
copies are always whole (fp16 of the true value). Copies are replaced whole (a download never sees half
of an update). The holder keeps, per local expert, its copy and the change (host memory).

With ``sync.lagged_refresh`` a round stages what it agreed (``stage``: an fp16 copy, host memory) and the
next refresh round serves it from its start (``publish_staged``), so that downloaders need not wait for
the holder's groups: the chain is the same, one round later.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Mapping, Sequence

import torch

from swarm.net.group_layout import item_expert
from swarm.net.transport import Group
from swarm.sync.codecs import Codec


def copy_hash(tensors: Sequence[torch.Tensor]) -> str:
    """A hash of an expert copy's fp16 values (a copy held in fp32 hashes alike if it holds fp16 values)."""
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().to("cpu", torch.float16).contiguous().view(torch.int16).numpy().tobytes())
    return h.hexdigest()[:24]


class ExpertServer:
    """See the module docstring."""

    def __init__(self, group: Group, deltas: Group | None = None, codec: Codec | None = None) -> None:
        self.group, self.deltas = group, deltas if codec is not None and not codec.lossless else None
        self.codec = codec
        self._copies: dict[str, tuple[list[torch.Tensor], int, bool]] = {}
        self._changes: dict[str, tuple[list[torch.Tensor], str, str]] = {}  # change, base hash, new hash
        self._staged: dict[str, tuple[list[torch.Tensor], int]] = {}  # fp16 copy, its step
        self._lock = threading.Lock()  # the round thread updates, the training thread keeps

    @property
    def groups(self) -> list[Group]:
        return [self.group] if self.deltas is None else [self.group, self.deltas]

    def update(self, items: Mapping[str, Sequence[torch.Tensor]], step: int, final: bool) -> None:
        """Serve these copies from now on (and drop any staged copy of them: these are newer)."""
        self._install({i: (ts, step) for i, ts in items.items()}, final)

    def stage(self, items: Mapping[str, Sequence[torch.Tensor]], step: int) -> None:
        """Copies to serve from the next ``publish_staged`` on, replacing any staged before."""
        staged = {
            i: ([t.detach().to("cpu", torch.float16, copy=True) for t in ts], step) for i, ts in items.items()
        }
        with self._lock:
            self._staged.update(staged)

    def staged(self) -> set[str]:
        with self._lock:
            return set(self._staged)

    def publish_staged(self) -> None:
        """Serve the staged copies (an ordinary, non-final update), and forget them."""
        with self._lock:
            staged, self._staged = self._staged, {}
        if staged:
            self._install(staged, final=False)

    def _install(self, items: Mapping[str, tuple[Sequence[torch.Tensor], int]], final: bool) -> None:
        copies, changes, steps = {}, {}, {i: step for i, (_, step) in items.items()}
        for i, (ts, _) in items.items():
            with self._lock:
                before = self._copies.get(i)
            if self.deltas is None or before is None or final:
                copies[i] = [t.detach().to("cpu", torch.float16, copy=True) for t in ts]
                continue
            change, new = self._change(ts, before[0])
            changes[i] = (change, self._hash(i, before[0]), copy_hash(new))
            copies[i] = new
        with self._lock:
            self._copies.update({i: (ts, steps[i], final) for i, ts in copies.items()})
            for i in copies:
                self._changes.pop(i, None)
                self._staged.pop(i, None)
            self._changes.update(changes)
            self._publish()

    def _change(
        self, tensors: Sequence[torch.Tensor], base: Sequence[torch.Tensor]
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """(fp32 change from the fp16 ``base`` to ``tensors``, fp16 ``base`` + the change's roundtrip)."""
        change, new = [], []
        for t, b in zip(tensors, base, strict=True):
            c = torch.sub(t.detach().to("cpu", torch.float32), b)  # the fp16 base promoted in the kernel
            change.append(c)
            new.append(self.codec.roundtrip(c).add_(b).half())  # a fresh tensor: added to in place
        return change, new

    def _hash(self, item: str, copy: Sequence[torch.Tensor]) -> str:
        """The hash of ``item``'s served ``copy``: the one its change named when a change made it."""
        with self._lock:
            made_by = self._changes.get(item)
        return made_by[2] if made_by is not None else copy_hash(copy)

    def keep(self, items: Sequence[str]) -> None:
        with self._lock:
            self._copies = {i: c for i, c in self._copies.items() if i in items}
            self._changes = {i: c for i, c in self._changes.items() if i in items}
            self._staged = {i: c for i, c in self._staged.items() if i in items}
            self._publish()

    def _publish(self) -> None:
        names = sorted(self._copies, key=item_expert)
        meta = {
            "items": names,
            "steps": [self._copies[i][1] for i in names],
            "final": [self._copies[i][2] for i in names],
        }
        self.group.serve([t for i in names for t in self._copies[i][0]], meta)
        if self.deltas is None:
            return
        names = sorted(self._changes, key=item_expert)
        meta = {
            "items": names,
            "steps": [self._copies[i][1] for i in names],
            "final": [False for _ in names],
            "base": [self._changes[i][1] for i in names],
            "hash": [self._changes[i][2] for i in names],
        }
        self.deltas.serve([t for i in names for t in self._changes[i][0]], meta)
