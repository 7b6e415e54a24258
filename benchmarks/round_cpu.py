"""A round's CPU work on a peer, alone and beside its training thread: what a round's fixed seconds cost.

    python benchmarks/round_cpu.py                                  # demo shape, int8, default device
    python benchmarks/round_cpu.py --shape wide --device cuda --json
    python benchmarks/round_cpu.py --switch-interval-ms 1           # the GIL handed over more often

A peer's round runs on a thread of the process that trains, and every torch op it runs gives up the GIL
and takes it back, so the same work can take far longer while the training thread runs (on a GPU peer that
thread is mostly Python launching kernels). Each part is the project's own code, called as ``run_round``
calls it, on host fp32 copies of a model of the chosen shape (``--shape`` as in wan.py, ``--set``), with a
peer's own ``RoundContext`` on hivemind (two DHT nodes on 127.0.0.1: ours, and a holder of the experts we
do not hold):

- ``serve``: ``ExpertServer.update`` of the peer's local experts (with a lossy codec: each change, its
  roundtrip and the new copy's hash);
- ``encode``: ``Payloads.encode`` of the dense payload against an agreed reference, and its error-feedback
  residual;
- ``digest``: ``round_consensus.digest`` of that payload (the round's consensus check);
- ``decode``: ``Payloads.decode`` and ``commit`` of an averaged payload;
- ``download``: ``ExpertDownloads.fetch`` of every expert we do not hold, as changes from the holder
  (its transfer on 127.0.0.1 and its decoding in hivemind's processes included), rebuilt onto our copies
  and checked.

For each: the tensors it goes through, the ATen ops it runs on the calling thread (``OpCounter``: a
download's work on its holder threads is not counted), and its median milliseconds over ``--repeats``
idle, then beside a training thread (the model's forward, backward and AdamW step on random tokens, on
``--device``), and their ratio; then the training steps per second alone and while the parts ran.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.op_count import OpCounter  # noqa: E402
from benchmarks.wan import SHAPES  # noqa: E402
from swarm.config import RunConfig, load_config  # noqa: E402
from swarm.model import MoETransformer  # noqa: E402
from swarm.net.dht_node import start_dht, visible_maddrs  # noqa: E402
from swarm.net.expert_tensors import dense_tensors, expert_tensors, snapshot  # noqa: E402
from swarm.net.group_layout import DENSE, GroupSpec, expert_item  # noqa: E402
from swarm.net.hivemind_group import close_groups  # noqa: E402
from swarm.net.hivemind_transport import HivemindStore, HivemindTransport  # noqa: E402
from swarm.net.round import RoundContext  # noqa: E402
from swarm.net.round_consensus import digest  # noqa: E402
from swarm.net.timing import Timing  # noqa: E402
from swarm.sync.codecs import CODECS, codec_named  # noqa: E402

PARTS = ("serve", "encode", "digest", "decode", "download")


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default=str(ROOT / "configs" / "demo.yaml"))
    ap.add_argument("--shape", choices=sorted(SHAPES), default="demo")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override")
    ap.add_argument("--codec", default="int8", choices=list(CODECS))
    ap.add_argument("--device", choices=["cpu", "cuda"], help="of the training thread (default: cuda if any)")
    ap.add_argument("--local", type=int, default=4, help="experts the peer holds (default 4)")
    ap.add_argument("--repeats", type=int, default=5, help="timed calls of each part (default 5)")
    ap.add_argument("--rate-s", type=float, default=2.0, help="training alone timed this long (default 2)")
    ap.add_argument("--switch-interval-ms", type=float, help="sys.setswitchinterval (default: Python's)")
    ap.add_argument("--json", action="store_true", help="one JSON object per line")
    return ap.parse_args(argv)


class RoundWork:
    """The parts of a round's CPU work on fixed host copies, with a peer's own ``RoundContext`` on hivemind
    (two DHT nodes on 127.0.0.1: ours, and a holder serving the experts we do not hold): ``run(part)``
    does one part once. Use as a context manager (it stops the hivemind processes)."""

    def __init__(self, cfg: RunConfig, model: MoETransformer, local: list[int]) -> None:
        self.dense = snapshot(dense_tensors(model))
        self.experts = {expert_item(e): snapshot(expert_tensors(model, e)) for e in local}
        others = [e for e in range(cfg.model.n_experts) if e not in local]
        self.frozen = {e: snapshot(expert_tensors(model, e)) for e in others}  # our copies of them
        self.dhts, self.contexts = [start_dht()], []
        try:  # nothing started is left running if the rest fails (or is interrupted)
            self.dhts.append(start_dht(visible_maddrs(self.dhts[0])))
            self.contexts = [_context(cfg, dht) for dht in self.dhts]
            self._prepare()
        except BaseException:
            self.__exit__()
            raise

    def _prepare(self) -> None:
        ours, holder = self.contexts
        self.server, self.downloads, self.holder = ours.server, ours.downloads, holder.me
        ours.server.update(self.experts, 0, final=False)  # the copies the next updates are changes against
        # the holder's experts: served at step 0 as we hold them, then changed at step 1
        theirs = {expert_item(e): ts for e, ts in self.frozen.items()}
        holder.server.update(theirs, 0, final=False)
        moved = {i: [t + 1e-3 * torch.randn_like(t) for t in ts] for i, ts in theirs.items()}
        holder.server.update(moved, 1, final=False)
        self.spec, self.payloads, self.step = GroupSpec("bench_dense", (DENSE,)), ours.payloads, 0
        first = self.payloads.encode(self.spec, {DENSE: self.dense}, {DENSE: 1.0})
        self._commit(first)  # an agreed reference: later payloads are changes against it
        self.sent = self.payloads.encode(self.spec, {DENSE: self.dense}, {DENSE: 1.0})

    def __enter__(self) -> RoundWork:
        return self

    def __exit__(self, *exc) -> None:
        for ctx in self.contexts:
            close_groups(ctx.server.groups)
        for dht in reversed(self.dhts):
            dht.shutdown()

    def _commit(self, sent) -> None:
        averaged = [t.clone() for t in sent.tensors]
        averages, _ = self.payloads.decode(self.spec, sent, averaged, {DENSE: len(self.dense)})
        self.payloads.commit(self.spec, sent, averages, f"ref{self.step}")

    def tensors(self, part: str) -> int:
        """How many tensors ``part`` goes through."""
        if part == "serve":
            return sum(map(len, self.experts.values()))
        if part == "download":
            return sum(map(len, self.frozen.values()))
        return len(self.dense) + 1

    def run(self, part: str) -> None:
        self.step += 1
        if part == "serve":
            self.server.update(self.experts, self.step, final=False)
        elif part == "encode":
            self.sent = self.payloads.encode(self.spec, {DENSE: self.dense}, {DENSE: 1.0})
            _ = self.sent.residuals
        elif part == "digest":
            digest(list(self.sent.tensors))
        elif part == "decode":
            self._commit(self.sent)
        elif part == "download":  # the holder's changes, rebuilt onto our copies and checked
            holders = {e: [(self.holder, 1)] for e in self.frozen}
            held = dict.fromkeys(self.frozen, 0)
            deadline = time.monotonic() + 60
            got, rejected, failures = self.downloads.fetch(holders, self.frozen, 1, False, deadline, held)
            if sorted(got) != sorted(self.frozen):
                raise RuntimeError(f"download: got {sorted(got)}; {rejected + failures}")
        else:
            raise ValueError(part)


def _context(cfg: RunConfig, dht) -> RoundContext:
    """A peer's round context on ``dht``, built as a peer builds it (``RoundContext.build``)."""
    timing = Timing.from_config(cfg.sync)
    transport = HivemindTransport(dht, timing, codec_named(cfg.sync.codec))
    return RoundContext.build(cfg, HivemindStore(dht), transport, timing)


class Training:
    """A training thread: the model's steps on random tokens until stopped; ``steps`` counts them."""

    def __init__(self, model: MoETransformer, batch: int, seq: int, device: torch.device) -> None:
        self.model, self.device = model, device
        self.tokens = torch.randint(0, model.cfg.vocab_size, (batch, seq + 1), device=device)
        self.optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
        self.steps, self._stop, self._thread = 0, threading.Event(), None

    def _loop(self) -> None:
        while not self._stop.is_set():
            out = self.model(self.tokens[:, :-1], self.tokens[:, 1:])
            out.loss.backward()
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            out.loss.item()  # a trainer reads its loss: on a GPU, the step's one wait for the device
            self.steps += 1

    def __enter__(self) -> Training:
        self._thread = threading.Thread(target=self._loop, name="bench-training", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=60)
        self._stop.clear()

    def rate(self, seconds: float, patience_s: float = 60.0) -> float:
        """Steps per second over at least the next ``seconds``, counted from the thread's first step (which
        also allocates the optimizer's state) and until one more step is in (on two cores shared with the
        parallel suite, a tiny model once took no step in 0.5 s and read 0); each wait at most
        ``patience_s``."""
        end = time.monotonic() + patience_s
        while self.steps == 0 and time.monotonic() < end:
            time.sleep(0.01)
        start, began = self.steps, time.perf_counter()
        time.sleep(seconds)
        while self.steps == start and time.monotonic() < end:
            time.sleep(0.01)
        return (self.steps - start) / (time.perf_counter() - began)


def timed(work: RoundWork, part: str, repeats: int) -> float:
    """Median milliseconds of ``repeats`` calls, after one untimed."""
    work.run(part)
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        work.run(part)
        times.append(time.perf_counter() - t)
    return 1000 * statistics.median(times)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.switch_interval_ms:
        sys.setswitchinterval(args.switch_interval_ms / 1000)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        print("error: --device cuda but no CUDA device", file=sys.stderr)
        return 2
    # its training thread steps a plain AdamW of its own: the preset's pooled moment (which needs an even
    # number of windows a step) has no part here, whatever --set data.micro_batch says
    fixed = [*SHAPES[args.shape], f"sync.codec={args.codec}", "train.pooled_moment=false"]
    cfg = load_config(args.config, fixed + args.set)
    local = list(range(min(args.local, cfg.model.n_experts)))
    model = MoETransformer(cfg.model, local_experts=local)
    model.init_weights(cfg.train.seed)  # every peer's start: its copies of the others' experts included
    model.to(device)
    with RoundWork(cfg, model, local) as work:
        ops = {}
        for part in PARTS:
            with OpCounter() as counter:
                work.run(part)
            ops[part] = sum(counter.counts.values())
        idle = {part: timed(work, part, args.repeats) for part in PARTS}
        training = Training(model, cfg.data.micro_batch, cfg.data.seq_len, device)
        with training:
            alone = training.rate(args.rate_s)
            t, start = time.perf_counter(), training.steps
            loaded = {part: timed(work, part, args.repeats) for part in PARTS}
            during = (training.steps - start) / (time.perf_counter() - t)
    rows = [
        {"part": p, "tensors": work.tensors(p), "ops": ops[p], "idle_ms": round(idle[p], 2), "training_ms": round(loaded[p], 2),
         "ratio": round(loaded[p] / idle[p], 2) if idle[p] > 0 else None}
        for p in PARTS
    ]  # fmt: skip
    summary = {
        "shape": args.shape, "codec": args.codec, "device": device.type, "torch_threads": torch.get_num_threads(),
        "switch_interval_ms": round(sys.getswitchinterval() * 1000, 3),
        "steps_per_s_alone": round(alone, 2), "steps_per_s_during": round(during, 2),
    }  # fmt: skip
    if args.json:
        for row in rows:
            print(json.dumps(row))
        print(json.dumps(summary))
        return 0
    print(f"{args.shape} shape, {args.codec}, training on {device.type}; "
          f"switch interval {summary['switch_interval_ms']:g} ms")  # fmt: skip
    print(f"{'part':8} {'ops':>6} {'idle ms':>9} {'training ms':>12} {'ratio':>6}")
    for r in rows:
        print(
            f"{r['part']:8} {r['ops']:>6} {r['idle_ms']:>9.1f} {r['training_ms']:>12.1f} {r['ratio']:>6.2f}"
        )
    print(f"training steps/s: {alone:.1f} alone, {during:.1f} while the parts ran")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
