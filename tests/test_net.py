"""The network layer with real hivemind processes on 127.0.0.1: averaging groups, downloads, consensus."""

import multiprocessing as mp
import time

import pytest
import torch

from swarm.net.averaging import AveragingGroup, download_state
from swarm.net.dht_node import start_dht, visible_maddrs
from swarm.net.records import Heartbeat, publish_heartbeat, read_heartbeats, withdraw_heartbeat
from swarm.net.round_consensus import confirm_round, digest, digests_agree

pytestmark = pytest.mark.timeout(180)


def _member(i, maddrs, out):
    dht = start_dht(maddrs)
    try:
        tensors = [torch.full((1000,), float(i + 1)), torch.arange(12.0).view(3, 4) * (i + 1)]
        group = AveragingGroup(dht, "t_dense", tensors, matchmaking_time=3.0, allreduce_timeout=30)
        time.sleep(1.0)
        control = group.start(
            tensors, weight=float(i + 1), info={"i": i, "weight": i + 1}, matchmaking_timeout=20
        )
        got = group.outcome(control, timeout=40, meta={"step": 7})
        out.put(
            (
                i,
                got.ok,
                got.reason,
                [t.tolist() for t in got.tensors],
                sorted(got.members),
                dht.peer_id.to_base58(),
            )
        )
        time.sleep(6)  # keep serving downloads for a moment
        group.shutdown()
    finally:
        dht.shutdown()


def test_group_average_is_the_exact_weighted_mean_and_is_served():
    boot = start_dht()
    ctx = mp.get_context("fork")
    out = ctx.Queue()
    procs = [ctx.Process(target=_member, args=(i, visible_maddrs(boot), out)) for i in range(3)]
    try:
        for p in procs:
            p.start()
        results = sorted(out.get(timeout=90) for _ in procs)
        want0 = (1 * 1 + 2 * 2 + 3 * 3) / 6
        for _i, ok, reason, tensors, members, _ in results:
            assert ok, reason
            assert len(members) == 3
            assert max(abs(v - want0) for v in tensors[0]) < 1e-6
            assert torch.allclose(torch.tensor(tensors[1]), torch.arange(12.0).view(3, 4) * want0, atol=1e-5)
        meta, served = download_state(boot, results[0][5], "t_dense", timeout=20)
        assert meta == {"step": 7}
        assert abs(served[0][0].item() - want0) < 2e-3  # fp16 on the wire
        for p in procs:
            p.join(timeout=30)
            assert p.exitcode == 0
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        boot.shutdown()


def test_digests_tolerate_rounding_but_not_untouched_parts():
    torch.manual_seed(0)
    a = [torch.randn(10_000), torch.randn(64, 32)]
    rounded = [t + 1e-7 * torch.randn_like(t) for t in a]
    assert digests_agree(digest(a), digest(rounded))
    partial = [a[0].clone(), a[1].clone()]
    partial[0][4000:4500] += 0.01  # a slice that kept this peer's own, unaveraged values
    assert not digests_agree(digest(a), digest(partial))


def test_round_confirmed_only_when_every_member_agrees():
    dht1 = start_dht()
    dht2 = start_dht(visible_maddrs(dht1))
    try:
        me, other = dht1.peer_id.to_base58(), dht2.peer_id.to_base58()
        d = digest([torch.ones(100)])
        # the other member never reports (it died mid-round): rejected after the timeout
        ok, why = confirm_round(dht1, "t_key1", me, [me, other], d, timeout=2.0)
        assert not ok and "no digest" in why
        # it reports a different result (part of the tensor never averaged): rejected
        dht2.store("t_key2", digest([torch.full((100,), 2.0)]), time.time() + 60, subkey=other)
        ok, why = confirm_round(dht1, "t_key2", me, [me, other], d, timeout=5.0)
        assert not ok and "differs" in why
        dht2.store("t_key3", d, time.time() + 60, subkey=other)
        assert confirm_round(dht1, "t_key3", me, [me, other], d, timeout=5.0) == (True, "")
    finally:
        dht2.shutdown()
        dht1.shutdown()


def test_heartbeats_round_trip_and_ignore_malformed_records():
    dht = start_dht()
    try:
        publish_heartbeat(
            dht, "t_run", "peerA", Heartbeat(experts=[1, 2], step=5, loss=float("nan")), ttl_s=30
        )
        dht.store("t_run_peers", {"experts": "not a list"}, time.time() + 30, subkey="peerB")
        dht.store("t_run_peers", 12345, time.time() + 30, subkey="peerC")
        beats = read_heartbeats(dht, "t_run")
        assert set(beats) == {"peerA"}
        hb, _ = beats["peerA"]
        assert hb.experts == [1, 2] and hb.step == 5 and hb.loss is None
        # leaving takes effect at once (a shorter-lived record would be ignored by hivemind)
        withdraw_heartbeat(dht, "t_run", "peerA", hb, ttl_s=30)
        assert read_heartbeats(dht, "t_run") == {}
    finally:
        dht.shutdown()


def test_groups_hold_host_fp32_tensors_whatever_the_models_device():
    """hivemind cannot average CUDA tensors (its compression calls .numpy()): a group built from a model's
    tensors on any device, in any dtype, holds host fp32 buffers ("meta" stands in for a GPU here)."""
    dht = start_dht()
    try:
        like = [torch.empty(3, 8, dtype=torch.bfloat16, device="meta"), torch.empty(5, device="meta")]
        group = AveragingGroup(dht, "t_meta", like)
        try:
            with group.averager.get_tensors() as held:
                got = [(t.device.type, t.dtype, tuple(t.shape)) for t in held]
            assert got == [("cpu", torch.float32, (3, 8)), ("cpu", torch.float32, (5,))]
        finally:
            group.shutdown()
    finally:
        dht.shutdown()
