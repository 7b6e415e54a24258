"""Shaped links between network namespaces (benchmarks/wan.py's network): the rate holds, bytes are counted,
and nothing is left behind. Needs root and iproute2 (skipped otherwise)."""

import subprocess
import sys
import time

import pytest

from benchmarks.netns_links import ShapedLan, check_can_shape

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


def test_a_shaped_link_carries_bytes_at_its_rate_and_everything_is_removed_after():
    size, mbit = 2_500_000, 20.0
    before = _namespaces()
    with ShapedLan(hosts=2, mbit=mbit) as lan:
        made = set(lan.namespaces)
        assert made <= _namespaces()
        server = subprocess.Popen(lan.command(0, [sys.executable, "-c", RECEIVE, lan.address(0)]),
                                  stdout=subprocess.PIPE, text=True)  # fmt: skip
        try:
            assert server.stdout.readline().strip() == "ready"
            sent0 = lan.counters(1)[0]
            t0 = time.monotonic()
            out = subprocess.run(lan.command(1, [sys.executable, "-c", SEND, lan.address(0), str(size)]),
                                 capture_output=True, text=True, timeout=30, check=True)  # fmt: skip
            assert server.wait(timeout=30) == 0
            took = time.monotonic() - t0
            assert int(server.stdout.readline()) == size
        finally:
            if server.poll() is None:
                server.kill()
                server.wait()
        # the payload alone needs size * 8 / rate seconds at the link's rate; loopback would take milliseconds
        assert took >= 0.9 * size * 8 / (mbit * 1e6), (took, out.stdout)
        assert took < 3 * size * 8 / (mbit * 1e6) + 1.0
        assert size <= lan.counters(1)[0] - sent0 < 1.1 * size  # headers on top, but not much
    assert not (made & _namespaces()) and _namespaces() == before
