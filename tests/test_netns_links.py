"""Shaped links between network namespaces (benchmarks/wan.py's network): the rate holds, bytes are counted,
and nothing is left behind. Needs root and iproute2 (skipped otherwise)."""

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from benchmarks.netns_links import ShapedLan, check_can_shape
from tests.process_table import alive

pytestmark = [
    pytest.mark.timeout(60),
    pytest.mark.skipif(check_can_shape() is not None, reason=str(check_can_shape())),
]

RECEIVE = """
import socket, sys
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], 5599)); s.listen(1); print("ready", flush=True)
c, _ = s.accept(); n = 0
while (b := c.recv(1 << 16)): n += len(b)
print(n, flush=True)
"""
SEND = """
import socket, sys, time
c = socket.create_connection((sys.argv[1], 5599), timeout=20); t = time.monotonic()
c.sendall(b"x" * int(sys.argv[2])); c.close(); print(time.monotonic() - t)
"""


def _namespaces() -> set[str]:
    return set(subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split())


def _send(lan: ShapedLan, size: int) -> tuple[float, int]:
    """Host 1 sends ``size`` bytes to host 0 over TCP: (seconds it took, bytes host 1's link counted)."""
    server = subprocess.Popen(lan.command(0, [sys.executable, "-c", RECEIVE, lan.address(0)]),
                              stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert server.stdout.readline().strip() == "ready"
        sent0, t0 = lan.counters(1)[0], time.monotonic()
        subprocess.run(lan.command(1, [sys.executable, "-c", SEND, lan.address(0), str(size)]),
                       capture_output=True, text=True, timeout=30, check=True)  # fmt: skip
        assert server.wait(timeout=30) == 0
        took = time.monotonic() - t0
        assert int(server.stdout.readline()) == size
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
    return took, lan.counters(1)[0] - sent0


def test_a_shaped_link_carries_bytes_at_its_rate_and_everything_is_removed_after():
    size, mbit = 2_500_000, 20.0
    before = _namespaces()
    with ShapedLan(hosts=2, mbit=mbit) as lan:
        made = set(lan.namespaces)
        assert made <= _namespaces()
        took, counted = _send(lan, size)
        # the payload alone needs size * 8 / rate seconds at the link's rate; loopback would take milliseconds
        assert took >= 0.9 * size * 8 / (mbit * 1e6), took
        assert took < 3 * size * 8 / (mbit * 1e6) + 1.0
        assert size <= counted < 1.1 * size  # headers on top, but not much
    assert not (made & _namespaces()) and _namespaces() == before


ECHO = """
import socket, sys
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], 5599)); s.listen(1); print("ready", flush=True)
c, _ = s.accept(); c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
while (b := c.recv(1)): c.sendall(b)
"""
PING = """
import socket, sys, time
c = socket.create_connection((sys.argv[1], 5599), timeout=20)
c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
times = []
for _ in range(9):
    t = time.monotonic(); c.sendall(b"p"); c.recv(1); times.append(time.monotonic() - t)
print(sorted(times)[4])
"""


def _links() -> set[str]:
    out = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    return {ln.split(":")[1].strip().split("@")[0] for ln in out.splitlines()}


def _median_rtt(lan: ShapedLan) -> float:
    server = subprocess.Popen(lan.command(0, [sys.executable, "-c", ECHO, lan.address(0)]),
                              stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert server.stdout.readline().strip() == "ready"
        out = subprocess.run(lan.command(1, [sys.executable, "-c", PING, lan.address(0)]),
                             capture_output=True, text=True, timeout=30, check=True)  # fmt: skip
        assert server.wait(timeout=10) == 0
        return float(out.stdout)
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()


@pytest.mark.parametrize("rtt_ms", [0.0, 40.0])
def test_delayed_links_add_the_round_trip_time_keep_the_rate_and_leave_nothing_behind(rtt_ms):
    size, mbit = 2_500_000, 20.0
    before_ns, before_links = _namespaces(), _links()
    with ShapedLan(hosts=2, mbit=mbit, rtt_ms=rtt_ms) as lan:
        line = lan._delay_line
        assert line is not None and line.poll() is None
        assert set(lan.host_ends) <= _links()  # the bridge's TAP ends, kept alive by the delay line
        rtt = _median_rtt(lan)
        # the delay line wakes on a 1 ms clock: up to about a millisecond late per hop, four hops a trip
        assert rtt_ms / 1000 <= rtt < rtt_ms / 1000 + 0.015, rtt
        took, counted = _send(lan, size)
        assert took >= 0.9 * size * 8 / (mbit * 1e6), took
        assert took < 3 * size * 8 / (mbit * 1e6) + 1.0 + 20 * rtt_ms / 1000  # TCP's start: a few trips
        assert size <= counted < 1.05 * size  # 9000-byte frames: fewer headers
    assert line.poll() == 0  # stopped by the end of its stdin
    assert _namespaces() == before_ns and _links() == before_links


OWNER = """
import json, sys, time
sys.path.insert(0, sys.argv[1])
from benchmarks.netns_links import ShapedLan
lan = ShapedLan(hosts=2, mbit=20, rtt_ms=10).__enter__()
print(json.dumps([lan._delay_line.pid, lan.host_ends, [*lan.namespaces, lan.bridge]]), flush=True)
time.sleep(60)
"""


def test_a_delay_line_dies_with_the_process_that_made_it_and_its_devices_with_it():
    from benchmarks.netns_links import remove_leftovers

    before_ns, before_links = _namespaces(), _links()
    root = str(Path(__file__).resolve().parents[1])
    owner = subprocess.Popen([sys.executable, "-c", OWNER, root], stdout=subprocess.PIPE, text=True)
    try:
        line_pid, taps, named = json.loads(owner.stdout.readline())
        assert set(taps) <= _links()
        owner.kill()  # SIGKILL: no cleanup of its own
        owner.wait(timeout=10)
        deadline = time.monotonic() + 10
        while alive(line_pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not alive(line_pid)
        assert not set(taps) & _links()  # the TAP devices went with the delay line's descriptors
        # what a later run finds and removes: the namespaces and the bridge
        assert set(named) <= set(remove_leftovers())
    finally:
        if owner.poll() is None:
            owner.kill()
            owner.wait()
        remove_leftovers()
    assert _namespaces() == before_ns and _links() == before_links


def test_sysctls_are_set_in_every_namespace_and_nowhere_else():
    key = "net.ipv4.tcp_slow_start_after_idle"

    def read(*prefix: str) -> str:
        return subprocess.run(
            [*prefix, "sysctl", "-n", key], capture_output=True, text=True, check=True
        ).stdout

    outside = read()
    flipped = "0" if outside.strip() == "1" else "1"
    with ShapedLan(hosts=2, mbit=20, sysctls={key: flipped}) as lan:
        assert [read(*lan.command(i, [])).strip() for i in range(2)] == [flipped, flipped]
        assert read() == outside
