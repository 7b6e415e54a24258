"""Measured traffic of a peer: the I/O counters of its own libp2p daemon (p2pd).

Everything this peer sends or receives over the swarm goes through its p2pd, which reads each outgoing
byte from a local unix socket and writes it to TCP, and reads each incoming byte from TCP and writes it to
a unix socket. So over an interval, (bytes read + bytes written) / 2 by p2pd is the traffic in both
directions, wire overhead (TLS, framing) and DHT requests included. Linux only (/proc); elsewhere None.
"""

from __future__ import annotations

from pathlib import Path


def find_p2pd(parent_pid: int) -> int | None:
    """The p2pd child of ``parent_pid`` (the DHT process), or None."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue
        comm = text[text.index("(") + 1 : text.rindex(")")]
        ppid = int(text[text.rindex(")") + 2 :].split()[1])
        if ppid == parent_pid and comm.startswith("p2pd"):
            return int(stat.parent.name)
    return None


class TrafficMeter:
    """``meter = TrafficMeter(dht.pid)``; ``meter.total()`` -> bytes through p2pd so far, or None."""

    def __init__(self, dht_pid: int) -> None:
        self.pid = find_p2pd(dht_pid)

    def total(self) -> int | None:
        if self.pid is None:
            return None
        try:
            fields = dict(line.split(": ") for line in Path(f"/proc/{self.pid}/io").read_text().splitlines())
        except (OSError, ValueError):
            return None
        return (int(fields["rchar"]) + int(fields["wchar"])) // 2
