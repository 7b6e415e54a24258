"""Bandwidth-limited links between processes on one machine: one network namespace per host, joined by a
bridge, each link shaped with ``tc`` in both directions. Needs root and iproute2.

    with ShapedLan(hosts=5, mbit=100) as lan:
        lan.address(0)                          # "10.213.0.1": host 0's address inside its namespace
        lan.command(0, ["python", "-m", ...])   # argv that runs inside host 0's namespace
        lan.counters(0)                         # (bytes host 0 sent, bytes it received) at its link

Shaping is a token bucket (``tbf``) on each side of a host's veth pair: egress inside the namespace limits
what the host uploads, egress on the bridge side what it downloads, each at ``mbit``. This kernel has no
``netem``, so no latency or loss is added: links are as fast as loopback in latency, limited in bandwidth
only. Everything made here is named after this process's id and removed on exit, also after an error or an
interruption; names left by a killed run are removed by ``remove_leftovers``.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

SUBNET = "10.213.0"
PREFIX = "swl"


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=20)


def _tc(*args: str) -> None:
    subprocess.run(["tc", *args], capture_output=True, text=True, check=True, timeout=20)


def check_can_shape() -> str | None:
    """Why links cannot be made here, or None."""
    if os.geteuid() != 0:
        return "needs root (network namespaces and tc)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"needs the {tool!r} command (iproute2)"
    return None


def remove_leftovers() -> list[str]:
    """Namespaces and bridges of earlier runs whose process is gone (a SIGKILLed benchmark)."""
    removed = []
    names = _ip("netns", "list", check=False).stdout.split()
    links = [ln.split(":")[1].strip().split("@")[0] for ln in _ip("-o", "link").stdout.splitlines()]
    for name in [n for n in names if n.startswith(PREFIX)] + [n for n in links if n.startswith(PREFIX)]:
        pid = re.match(r"\d*", name[len(PREFIX) :]).group()
        if pid and not Path(f"/proc/{pid}").exists():
            if name in names:
                _ip("netns", "delete", name, check=False)
            else:
                _ip("link", "delete", name, check=False)
            removed.append(name)
    return removed


def prepare_benchmark() -> str | None:
    """What a benchmark that shapes links does first: why it cannot run here (or None); names left by a
    killed earlier run removed (said on stderr); SIGTERM raised as KeyboardInterrupt from then on, so that
    the benchmark's cleanup (its processes stopped, ``ShapedLan`` closed) runs when it is stopped."""
    why = check_can_shape()
    if why:
        return why
    for name in remove_leftovers():
        print(f"removed {name}, left by an earlier run", file=sys.stderr)

    def interrupted(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupted)
    return None


class ShapedLan:
    """See the module docstring. ``hosts``: at most 250."""

    def __init__(self, hosts: int, mbit: float) -> None:
        if not 1 <= hosts <= 250 or mbit <= 0:
            raise ValueError("hosts must be in [1, 250] and mbit > 0")
        self.hosts, self.mbit = hosts, mbit
        tag = f"{PREFIX}{os.getpid()}"
        self.bridge = f"{tag}b"
        self.namespaces = [f"{tag}n{i}" for i in range(hosts)]
        self.host_ends = [f"{tag}h{i}" for i in range(hosts)]  # the bridge side of each veth pair
        self._made: list[tuple[str, str]] = []

    def address(self, i: int) -> str:
        return f"{SUBNET}.{i + 1}"

    def command(self, i: int, argv: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.namespaces[i], *argv]

    def counters(self, i: int) -> tuple[int, int]:
        """(bytes host i sent, bytes it received) so far, IP headers included, read on the bridge side."""
        stats = Path(f"/sys/class/net/{self.host_ends[i]}/statistics")
        return int((stats / "rx_bytes").read_text()), int((stats / "tx_bytes").read_text())

    def _shape(self, dev: str, netns: str | None = None) -> None:
        rate = f"{self.mbit}mbit"
        # a burst of at least a few ms at the link's rate (tbf needs rate / HZ at the very least)
        burst = f"{max(32, int(self.mbit * 1e6 / 8 / 100 / 1024))}kb"
        args = ["qdisc", "add", "dev", dev, "root", "tbf", "rate", rate, "burst", burst, "latency", "100ms"]
        _tc(*args) if netns is None else _ip("netns", "exec", netns, "tc", *args)

    def __enter__(self) -> ShapedLan:
        try:
            _ip("link", "add", self.bridge, "type", "bridge")
            self._made.append(("link", self.bridge))
            _ip("link", "set", self.bridge, "up")
            for i, (ns, host_end) in enumerate(zip(self.namespaces, self.host_ends, strict=True)):
                _ip("netns", "add", ns)
                self._made.append(("netns", ns))
                inner = f"{host_end}x"
                _ip("link", "add", host_end, "type", "veth", "peer", "name", inner)
                self._made.append(("link", host_end))
                _ip("link", "set", inner, "netns", ns)
                _ip("netns", "exec", ns, "ip", "link", "set", inner, "name", "eth0")
                _ip("netns", "exec", ns, "ip", "addr", "add", f"{self.address(i)}/24", "dev", "eth0")
                _ip("netns", "exec", ns, "ip", "link", "set", "eth0", "up")
                _ip("netns", "exec", ns, "ip", "link", "set", "lo", "up")
                _ip("link", "set", host_end, "master", self.bridge)
                _ip("link", "set", host_end, "up")
                self._shape("eth0", ns)  # what the host uploads
                self._shape(host_end)  # what it downloads
        except BaseException:
            self.close()
            raise
        return self

    def close(self) -> None:
        """Remove everything made, newest first (deleting a namespace deletes the veth pair in it)."""
        while self._made:
            kind, name = self._made.pop()
            if kind == "netns":
                _ip("netns", "delete", name, check=False)
            else:
                _ip("link", "delete", name, check=False)

    def __exit__(self, *exc) -> None:
        self.close()
