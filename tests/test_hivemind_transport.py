"""The hivemind transport with real hivemind processes on 127.0.0.1: groups, serving, consensus (its signed
records: ``test_hivemind_store``)."""

import dataclasses
import faulthandler
import multiprocessing as mp
import signal
import sys
import threading
import time
from concurrent.futures import TimeoutError as FutureTimeout
from pathlib import Path

import pytest
import torch
from hivemind.averaging.control import AveragingStage, StepControl
from hivemind.utils.mpfuture import MPFuture

from swarm.net import stream_linger
from swarm.net.dht_node import hivemind_child_signals, start_dht, visible_maddrs
from swarm.net.hivemind_group import HivemindGroup, await_step, close_groups
from swarm.net.hivemind_transport import HivemindStore, HivemindTransport
from swarm.net.round_consensus import (
    StoreDigests,
    abs_sums,
    await_digests,
    digest,
    digests_agree,
    publish_digest,
)
from swarm.net.served_prints import metadata_only
from swarm.net.served_steps import Fresh
from swarm.net.timing import Timing
from swarm.net.traffic import TrafficMeter
from swarm.sync.codecs import codec_named

pytestmark = pytest.mark.timeout(180)
# what a dense group serves with its weights (served_prints): 40 KiB, more than one pipe message may carry
PRINTS = {f"expert{e}": bytes([e]) * 1024 for e in range(40)}
EXPERT_NUMEL = 1_000_000  # 2 MB as served: what a refused download must not move
TIMING = Timing(matchmaking_s=3.0, round_s=30.0, download_s=20.0, heartbeat_s=1.0, request_s=1.5,
                final_agreement_s=5.0)  # fmt: skip


def _member(i, maddrs, out, ready):
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # the finally below stops our groups, DHT and p2pd
    # forked from a worker whose OpenMP pool earlier tests used: a parallel torch op (filling the 1M-value
    # copy below) would wait forever for the pool's threads, which the fork did not copy
    torch.set_num_threads(1)
    faulthandler.dump_traceback_later(60, exit=False)  # a member still here after 60 s says where it is
    # a reply stream stays open 30 s unless its caller closes it: a download here (timeout 20 s) that did
    # not close at the copy's end would come back empty (forked: the averagers get it too)
    stream_linger.LINGER_S = 30.0
    dht, opened = start_dht(maddrs), []
    try:
        transport = HivemindTransport(dht, TIMING)
        tensors = [torch.full((1000,), float(i + 1)), torch.arange(12.0).view(3, 4) * (i + 1)]
        group = transport.open("t_dense", tensors)
        server = transport.open_server("t_experts")
        opened += [group, server]
        server.serve(
            [torch.full((EXPERT_NUMEL,), float(i), dtype=torch.float16)],
            {"items": ["expert0"], "steps": [i], "final": [False]},
        )
        # all three look for a group at once: a member whose start up took longer than the leader's
        # matchmaking window (3 s, under the suite's load) would leave the other two to average as a pair
        ready.wait(timeout=60)
        handle = group.start(
            iter(tensors), {"i": i}, matchmaking_s=20, expected=3
        )  # begins once all 3 are in
        got = group.outcome(handle, timeout=40)
        if got.ok:
            group.serve(got.tensors, {"step": 7, "prints": PRINTS})
        if i == 0:  # a round no one else joins: its buffers are not served meanwhile, its prints still are
            group.start(iter(tensors), {"i": i}, matchmaking_s=5)
        out.put((i, got.ok, got.reason, [t.tolist() for t in got.tensors], sorted(got.members), transport.me))
        time.sleep(6)  # keep serving downloads for a moment
    finally:  # also when the test stops us early (SIGTERM): averagers killed unclosed leave p2p sockets behind
        close_groups(opened)
        dht.shutdown()


def test_members_average_to_the_exact_mean_and_serve_copies():
    boot = start_dht()
    ctx = mp.get_context("fork")
    out, ready = ctx.Queue(), ctx.Barrier(3)
    procs = [ctx.Process(target=_member, args=(i, visible_maddrs(boot), out, ready)) for i in range(3)]
    try:
        for p in procs:
            p.start()
        results = sorted(out.get(timeout=90) for _ in procs)
        want0 = (1 + 2 + 3) / 3
        for _i, ok, reason, tensors, members, _ in results:
            assert ok, reason
            assert len(members) == 3
            assert max(abs(v - want0) for v in tensors[0]) < 1e-6
            assert torch.allclose(torch.tensor(tensors[1]), torch.arange(12.0).view(3, 4) * want0, atol=1e-5)
        transport = HivemindTransport(boot, TIMING)
        served = transport.fetch(results[1][5], "t_dense", timeout=20)
        assert served.meta == {"step": 7, "prints": PRINTS}
        assert served.tensors[0].dtype == torch.float32 and served.tensors[0][0].item() == want0  # exact
        during = transport.fetch(results[0][5], "t_dense", timeout=20, accept=metadata_only)
        assert during.meta == {"prints": PRINTS} and during.tensors == []
        assert not getattr(transport.fetch(results[0][5], "t_dense", timeout=5), "tensors", None)
        served = transport.fetch(results[2][5], "t_experts", timeout=20)
        assert served.meta["items"] == ["expert0"] and served.tensors[0].dtype == torch.float16
        assert served.tensors[0].shape == (EXPERT_NUMEL,) and bool((served.tensors[0] == 2.0).all())
        # a poll for a fresher copy than the holder has moves the metadata, not the tensors
        meter, holder = TrafficMeter(boot.pid), results[2][5]
        before = meter.total()
        stale = transport.fetch(holder, "t_experts", timeout=20, accept=Fresh(("expert0",), 3, final=False))
        moved = meter.total() - before
        assert stale.meta["steps"] == [2] and stale.tensors == []
        assert moved < 2**16, moved  # less than one streamed part of the copy
        fresh = transport.fetch(holder, "t_experts", timeout=20, accept=Fresh(("expert0",), 2, final=False))
        assert fresh.tensors[0].shape == (EXPERT_NUMEL,)
        # a copy larger than the downloader's bound (``copy_bound``) is cut off, not taken into memory
        capped = HivemindTransport(boot, TIMING, max_copy_bytes=EXPERT_NUMEL)  # half the fp16 copy
        assert capped.fetch(holder, "t_experts", timeout=20) is None
        roomy = HivemindTransport(boot, TIMING, max_copy_bytes=3 * EXPERT_NUMEL)
        assert roomy.fetch(holder, "t_experts", timeout=20).tensors[0].shape == (EXPERT_NUMEL,)
        assert transport.fetch("12D3KooWQYhTNQdmr3ArTeUHRYzFg94BKyTkoWBDWez9kSCVe2Xo", "t_dense", 3) is None
        for p in procs:
            p.join(timeout=30)
            assert p.exitcode == 0
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
                p.join(timeout=15)
            if p.is_alive():
                p.kill()
        boot.shutdown()


@pytest.mark.parametrize(("name", "dense_codec", "levels"), [("t_int8", None, 127), ("t_dense", "int4", 7)])
def test_a_blockwise_group_averages_within_the_codecs_error_and_small_tensors_exactly(
    name, dense_codec, levels
):
    """An int8 group; and a dense group, whose codec may be another (``sync.dense_codec``)."""
    dht1 = start_dht()
    dht2 = start_dht(visible_maddrs(dht1))
    codec, groups = codec_named("int8"), []
    dense = codec_named(dense_codec) if dense_codec else None
    try:
        sent = [[torch.randn(4096, generator=torch.Generator().manual_seed(i)), torch.tensor([1.0 + i, 0.3])]
                for i in range(2)]  # fmt: skip
        # the step's window is shorter than the averagers' matchmaking time, as a round's late in its slot is
        # (``Timing.matchmaking_left``); hivemind refused such a step, and now it forms once complete
        timing = dataclasses.replace(TIMING, matchmaking_s=12.0)
        for dht in (dht1, dht2):
            groups.append(HivemindTransport(dht, timing, codec, dense_codec=dense).open(name, sent[0]))
        handles = [
            g.start(iter(ts), {}, matchmaking_s=10, expected=2) for g, ts in zip(groups, sent, strict=True)
        ]
        outcomes = [g.outcome(h, timeout=40) for g, h in zip(groups, handles, strict=True)]
        mean = [(a + b) / 2 for a, b in zip(*sent, strict=True)]
        step = max(t.abs().max().item() for t in (sent[0][0], sent[1][0])) / levels
        errors = []
        for out in outcomes:
            assert out.ok, out.reason
            errors.append((out.tensors[0] - mean[0]).abs().max().item())
            assert out.tensors[1].tolist() == mean[1].tolist()  # the weights travel exactly
        # each member keeps the mean it reduced itself and gets the rest back encoded: within about two
        # steps (its own part and the difference to the mean each rounded once), and not exact
        assert step / 100 < max(errors) <= 2 * step, (errors, step)
    finally:
        for g in groups:
            g.close()
        dht2.shutdown()
        dht1.shutdown()


def test_digests_tolerate_rounding_but_not_untouched_parts():
    torch.manual_seed(0)
    a = [torch.randn(10_000), torch.randn(64, 32)]
    rounded = [t + 1e-7 * torch.randn_like(t) for t in a]
    assert digests_agree(digest(a), digest(rounded))
    assert abs_sums(a) == digest(a)[0::2]  # the floor a lossy round passes, without the projections
    partial = [a[0].clone(), a[1].clone()]
    partial[0][4000:4500] += 0.01  # a slice that kept this peer's own, unaveraged values
    assert not digests_agree(digest(a), digest(partial))


def confirm_round(store, key, me, members, mine, timeout):
    assert publish_digest(store, key, me, mine, timeout)
    return await_digests(StoreDigests(store, me), key, me, members, mine, timeout)


def test_round_confirmed_only_when_every_member_agrees():
    dht1 = start_dht()
    dht2 = start_dht(visible_maddrs(dht1))
    try:
        me, other = dht1.peer_id.to_base58(), dht2.peer_id.to_base58()
        d = digest([torch.ones(100)])
        # the other member never reports (it died mid-round): rejected after the timeout
        store1 = HivemindStore(dht1)
        ok, why = confirm_round(store1, "t_key1", me, [me, other], d, timeout=2.0)
        assert not ok and "no digest" in why
        # it reports a different result (part of the tensor never averaged): rejected
        store2 = HivemindStore(dht2)
        store2.put("t_key2", digest([torch.full((100,), 2.0)]), time.time() + 60, subkey=other)
        ok, why = confirm_round(store1, "t_key2", me, [me, other], d, timeout=5.0)
        assert not ok and "differs" in why
        store2.put("t_key3", d, time.time() + 60, subkey=other)
        assert confirm_round(store1, "t_key3", me, [me, other], d, timeout=5.0) == (True, "")
    finally:
        dht2.shutdown()
        dht1.shutdown()


def test_groups_hold_host_fp32_tensors_whatever_the_models_device():
    """hivemind cannot average CUDA tensors (its compression calls .numpy()): a group built from a model's
    tensors on any device, in any dtype, holds host fp32 buffers ("meta" stands in for a GPU here)."""
    dht = start_dht()
    try:
        like = [torch.empty(3, 8, dtype=torch.bfloat16, device="meta"), torch.empty(5, device="meta")]
        group = HivemindGroup(dht, "t_meta", like)
        try:
            with group.averager.get_tensors() as held:
                got = [(t.device.type, t.dtype, tuple(t.shape)) for t in held]
            assert got == [("cpu", torch.float32, (3, 8)), ("cpu", torch.float32, (5,))]
        finally:
            group.close()
    finally:
        dht.shutdown()


def _signal_masks(pid: int) -> dict[str, int]:
    status = Path(f"/proc/{pid}/status").read_text()
    fields = dict(ln.split(":\t", 1) for ln in status.splitlines() if ":\t" in ln)
    return {k: int(fields[k], 16) for k in ("SigBlk", "SigIgn", "SigCgt")}


def _has(mask: int, sig: signal.Signals) -> bool:
    return bool(mask >> (sig - 1) & 1)


def test_hivemind_processes_ignore_ctrl_c_and_a_ctrl_c_while_they_start_is_not_lost():
    """Ctrl+C reaches a peer's whole process group: its hivemind processes ignore it (the peer shuts them
    down) and die of SIGTERM; the peer itself keeps its handler, and a Ctrl+C that lands while it forks one
    is delivered right after instead of being dropped."""
    got: list[int] = []
    before = signal.signal(signal.SIGINT, lambda signum, frame: got.append(signum))
    dht = start_dht()
    try:
        group = HivemindGroup(dht, "t_signals", [torch.zeros(4)])
        try:
            assert signal.getsignal(signal.SIGINT) is not signal.SIG_IGN  # hivemind's would leave it so
            for pid in (dht.pid, group.averager.pid):
                m = _signal_masks(pid)
                assert _has(m["SigIgn"], signal.SIGINT) and not _has(m["SigCgt"], signal.SIGTERM), m
                assert not _has(m["SigBlk"], signal.SIGINT) and not _has(m["SigBlk"], signal.SIGTERM), m
        finally:
            group.close()
        with hivemind_child_signals():
            signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)
            time.sleep(0.1)
            assert got == []  # held back while a child would be forking
        time.sleep(0.1)
        assert got == [signal.SIGINT]
    finally:
        dht.shutdown()
        signal.signal(signal.SIGINT, before)


def test_a_large_announcement_reaches_the_averager_in_parts_that_are_each_one_pipe_write():
    """CPython writes a pipe message over 16 KiB as two writes, which hivemind's child may read apart (the
    averager's command loop then dies: seen with 17 KiB of prints); parts stay under that size."""
    import asyncio
    import pickle

    from hivemind.utils import MSGPackSerializer

    from swarm.net.serving_averager import ServingAverager

    sent = []

    class Pipe:
        def send(self, message):
            sent.append(message)

    averager = object.__new__(ServingAverager)  # the host's and the child's halves, without the processes
    averager._outer_pipe = Pipe()
    meta = {"items": ["dense"], "prints": PRINTS}
    averager.announce(meta)
    assert len(sent) > 1 and all(len(pickle.dumps(m)) < 16384 for m in sent)
    for method, args, kwargs in sent:
        asyncio.run(getattr(averager, method)(*args, **kwargs))
    assert MSGPackSerializer.loads(averager._announced) == meta
    sent.clear()
    averager.announce({})  # a small one is one part
    assert len(sent) == 1
    asyncio.run(averager._announce(*sent[0][1]))
    assert MSGPackSerializer.loads(averager._announced) == {}


def test_a_group_whose_averager_never_gets_ready_or_whose_dht_is_gone_fails_instead_of_waiting_forever(
    monkeypatch,
):
    """hivemind waits for a new averager without a timeout; one whose request to its DHT process is never
    answered (a DHT process that died: seen in the suite) would wait forever. Opening a group is bounded
    (``READY_S``), leaves no averager process behind, and a dead DHT node is refused at once."""
    import asyncio

    import hivemind

    from swarm.net import serving_averager
    from swarm.net.serving_averager import AveragerStartError

    async def unanswered(self):  # the averager asks its DHT process for the daemon and hears nothing
        await asyncio.Event().wait()

    monkeypatch.setattr(serving_averager, "READY_S", 3.0)
    dht = start_dht()
    transport = HivemindTransport(dht, TIMING)
    before = set(mp.active_children())
    with monkeypatch.context() as patch:  # the averager's process is forked with the patched class
        patch.setattr(hivemind.DHT, "replicate_p2p", unanswered)
        t0 = time.monotonic()
        with pytest.raises(AveragerStartError, match="not ready in 3 s"):
            transport.open("t_unready", [torch.zeros(10)])
    assert time.monotonic() - t0 < 3.0 + 6.0
    assert set(mp.active_children()) - before == set()  # the stuck averager was stopped
    group = transport.open("t_ready", [torch.zeros(10)])  # the node itself is fine
    transport.close_groups([group])
    dht.shutdown()
    dht.join(timeout=10)  # shutdown may end by terminating it, which does not wait for the process to go
    t0 = time.monotonic()
    with pytest.raises(AveragerStartError, match="DHT node's process is not running"):
        transport.open("t_dead", [torch.zeros(10)])
    assert time.monotonic() - t0 < 1.0 and set(mp.active_children()) - before == set()


class _EndsAsTheWaitTimesOut(StepControl):
    """A step whose result arrives just as one of our short waits times out: the race in which a success
    used to be reported as a failure ("TimeoutError: "), leaving the partners waiting for our digest."""

    def __init__(self, gathered):
        super().__init__(time.time(), time.time() + 60, False, 1.0, b"")
        self.attach(MPFuture(), MPFuture())  # as the averager does
        self.gathered, self.waits = gathered, 0

    def result(self, timeout=None):
        self.waits += 1
        if self.waits == 3 and not self.done():
            self.set_result(self.gathered)
            raise FutureTimeout()
        return super().result(timeout)


def test_a_step_that_ends_as_a_wait_times_out_is_taken_as_it_ended():
    MPFuture()  # hivemind's futures need their backend in this process (a DHT or an averager starts it)
    step = _EndsAsTheWaitTimesOut({"peer": b"info"})
    gathered, formed_at, why = await_step(step, timeout=5.0, poll=0.01)
    assert why == "" and gathered == {"peer": b"info"} and formed_at > 0 and step.waits == 4
    failed, never = (StepControl(time.time(), time.time() + 60, False, 1.0, b"") for _ in range(2))
    for step in (failed, never):
        step.attach(MPFuture(), MPFuture())
    failed.set_exception(TimeoutError("inside hivemind"))
    assert await_step(failed, timeout=5.0) == (None, 0.0, "TimeoutError: inside hivemind")
    t0 = time.monotonic()
    gathered, _, why = await_step(never, timeout=0.3, poll=0.05)
    assert gathered is None and why == "TimeoutError: no result within 0.3 s" and time.monotonic() - t0 < 2


def test_a_triggered_step_whose_averager_never_takes_the_trigger_is_given_up_early():
    """Its group formed, we triggered it, and the averager still waits for the trigger: given up once its
    members have left it out (``untaken_s``), not held for the whole round; a step that waits and then
    begins its all-reduce is not."""
    MPFuture()
    stuck, slow = (StepControl(time.time(), time.time() + 60, False, 1.0, b"") for _ in range(2))
    for step in (stuck, slow):
        step.attach(MPFuture(), MPFuture())
        step.stage = AveragingStage.AWAITING_TRIGGER
    t0 = time.monotonic()
    gathered, _, why = await_step(stuck, timeout=30.0, poll=0.02, untaken_s=0.3)
    assert gathered is None and why.startswith("TriggerNotTaken") and stuck.cancelled()
    assert 0.3 <= time.monotonic() - t0 < 3
    threading.Timer(0.2, lambda: setattr(slow, "stage", AveragingStage.RUNNING_ALLREDUCE)).start()
    threading.Timer(0.6, lambda: slow.set_result({"peer": b"info"})).start()
    gathered, formed_at, why = await_step(slow, timeout=30.0, poll=0.02, untaken_s=0.3)
    assert why == "" and gathered == {"peer": b"info"} and formed_at > 0
