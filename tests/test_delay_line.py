"""The delay line (``benchmarks/delay_line.py``) on datagram socket pairs, which keep frame boundaries as TAP
descriptors do: every frame crosses, in order, each way, no sooner than the delay; the line stops when its
stop descriptor closes. No root needed."""

import os
import socket
import threading
import time

import pytest

from benchmarks.delay_line import run

pytestmark = pytest.mark.timeout(30)


def _pair() -> tuple[socket.socket, socket.socket]:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    b.setblocking(False)  # the line's end
    return a, b


def _recv_frames(sock: socket.socket, n: int, timeout: float = 5.0) -> list[tuple[float, bytes]]:
    sock.settimeout(timeout)
    got = []
    for _ in range(n):
        frame = sock.recv(65536)
        got.append((time.monotonic(), frame))
    return got


def test_frames_cross_both_ways_in_order_each_no_sooner_than_the_delay_and_the_line_stops_at_eof():
    (host, host_line), (bridge, bridge_line) = _pair(), _pair()
    stop_r, stop_w = os.pipe()
    delay = 0.05
    line = threading.Thread(target=run, args=([(host_line.fileno(), bridge_line.fileno())], delay, stop_r))
    line.start()
    try:
        frames = [bytes([i]) * (100 + 37 * i) for i in range(20)]
        sent_at = time.monotonic()
        for f in frames:
            host.send(f)
        got = _recv_frames(bridge, len(frames))
        assert [f for _, f in got] == frames  # whole frames, in order
        assert min(t for t, _ in got) - sent_at >= delay
        assert max(t for t, _ in got) - sent_at < delay + 1.0
        # the other way, and a large frame
        back_at = time.monotonic()
        bridge.send(b"y" * 60000)
        ((t, frame),) = _recv_frames(host, 1)
        assert frame == b"y" * 60000 and t - back_at >= delay
        # nothing crosses that was not sent
        host.settimeout(0.2)
        with pytest.raises(TimeoutError):
            host.recv(65536)
    finally:
        os.close(stop_w)  # EOF: the line returns
        line.join(timeout=5)
        os.close(stop_r)
        for s in (host, host_line, bridge, bridge_line):
            s.close()
    assert not line.is_alive()


def test_a_frame_written_to_a_closed_end_is_lost_not_fatal():
    (host, host_line), (bridge, bridge_line) = _pair(), _pair()
    stop_r, stop_w = os.pipe()
    line = threading.Thread(target=run, args=([(host_line.fileno(), bridge_line.fileno())], 0.01, stop_r))
    line.start()
    try:
        bridge.close()  # the far side is gone: writes to its line end fail
        host.send(b"lost")
        time.sleep(0.1)
        assert line.is_alive()
    finally:
        os.close(stop_w)
        line.join(timeout=5)
        os.close(stop_r)
        for s in (host, host_line, bridge_line):
            s.close()
    assert not line.is_alive()
