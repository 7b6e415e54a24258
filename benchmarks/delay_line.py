"""Latency for ``netns_links``: a process that carries Ethernet frames between pairs of TAP devices, each
frame ``delay_ms`` after it was read. This kernel has no ``netem`` (and no ``fq`` or ``etf`` qdisc to pace
by departure time), so the delay is added in user space.

    python benchmarks/delay_line.py --delay-ms 12.5 --pairs 3,4 5,6   # fds inherited from the caller

Each pair is two open TAP file descriptors (``IFF_TAP | IFF_NO_PI``, non-blocking), one in a host's
namespace (its ``eth0``) and one on the bridge; frames go both ways, each direction a FIFO of its own, so
order is kept and every frame waits the same time. The process exits when its standard input closes (the
caller, ``ShapedLan``, holds the other end: a caller killed with SIGKILL takes the delay line with it), and
the TAP devices disappear with its descriptors.

Its cost is CPU per frame (one read and one write, about 10 us in Python); ``ShapedLan`` raises the links'
MTU to 9000 bytes so that a 100 Mbit/s link needs about 1400 frames a second, not 8300.
"""

from __future__ import annotations

import argparse
import collections
import errno
import fcntl
import os
import select
import struct
import sys
import time

TUNSETIFF = 0x400454CA
IFF_TAP, IFF_NO_PI = 0x0002, 0x1000
MAX_FRAME = 65536
# frames that may wait in one direction: at 100 Mbit/s and 9000 bytes, about 6 s worth. More are dropped,
# as a full router queue would (TCP backs off), instead of holding the memory of a runaway sender
MAX_QUEUED = 8192


def open_tap(name: str) -> int:
    """A new TAP device ``name`` (in this process's namespace; it may be moved to another after), as a
    non-blocking file descriptor that reads and writes whole Ethernet frames. It lives as long as the fd."""
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
    try:
        fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", name.encode(), IFF_TAP | IFF_NO_PI))
    except OSError:
        os.close(fd)
        raise
    return fd


def run(pairs: list[tuple[int, int]], delay_s: float, stop_fd: int | None = 0) -> None:
    """Carry frames between each pair's two fds, each ``delay_s`` late, until ``stop_fd`` reports EOF."""
    peer_of = {a: b for a, b in pairs} | {b: a for a, b in pairs}
    queued = {fd: collections.deque() for fd in peer_of}  # frames read from fd: (due, frame)
    poller = select.epoll()
    for fd in peer_of:
        poller.register(fd, select.EPOLLIN)
    if stop_fd is not None:
        poller.register(stop_fd, select.EPOLLIN | select.EPOLLHUP)
    while True:
        now = time.monotonic()
        due = min((q[0][0] for q in queued.values() if q), default=None)
        timeout = -1 if due is None else max(0.0, due - now)
        for fd, _ in poller.poll(timeout):
            if fd == stop_fd:
                return  # the caller is gone (or closed our stdin): stop
            if not _read_all(fd, queued[fd], time.monotonic() + delay_s):
                poller.unregister(fd)  # its device is gone: what it sent still crosses
        now = time.monotonic()
        for fd, q in queued.items():
            out = peer_of[fd]
            while q and q[0][0] <= now:
                frame = q.popleft()[1]
                try:
                    os.write(out, frame)
                except OSError as e:  # a device down or gone, or no room: the frame is lost, as on a wire
                    if e.errno == errno.EBADF:  # not a descriptor of ours: a bug, not the network
                        raise


def _read_all(fd: int, q: collections.deque, due: float) -> bool:
    """Queue every frame ``fd`` has now; False once it has nothing more to give (its device gone)."""
    while True:
        try:
            frame = os.read(fd, MAX_FRAME)
        except BlockingIOError:
            return True
        except OSError as e:  # the device went down for good (its namespace deleted)
            if e.errno == errno.EBADF:
                raise
            return False
        if not frame:
            return False
        if len(q) < MAX_QUEUED:
            q.append((due, frame))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--delay-ms", type=float, required=True, help="added to every frame, each direction")
    ap.add_argument("--pairs", nargs="+", required=True, metavar="FD,FD", help="inherited TAP descriptors")
    args = ap.parse_args(argv)
    pairs = [tuple(int(x) for x in p.split(",")) for p in args.pairs]
    if args.delay_ms < 0 or any(len(p) != 2 for p in pairs):
        ap.error("--delay-ms must be >= 0 and each pair two descriptors")
    try:
        run(pairs, args.delay_ms / 1000)
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
