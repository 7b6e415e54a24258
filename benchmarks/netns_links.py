"""Bandwidth-limited links between processes on one machine: one network namespace per host, joined by a
bridge, each link shaped with ``tc`` in both directions. Needs root and iproute2.

    with ShapedLan(hosts=5, mbit=100) as lan:
        lan.address(0)                          # "10.213.0.1": host 0's address inside its namespace
        lan.command(0, ["python", "-m", ...])   # argv that runs inside host 0's namespace
        lan.counters(0)                         # (bytes host 0 sent, bytes it received) at its link
    with ShapedLan(hosts=5, mbit=100, rtt_ms=50) as lan: ...   # and 50 ms between any two hosts
    ShapedLan(hosts=5, mbit=100, sysctls={"net.ipv4.tcp_slow_start_after_idle": "0"})   # in every namespace

Shaping is a token bucket (``tbf``) on each side of a host's link: egress inside the namespace limits what
the host uploads, egress on the bridge side what it downloads, each at ``mbit``. Without ``rtt_ms`` a link
is a veth pair: as fast as loopback in latency, limited in bandwidth only. This kernel has no ``netem``
(nor ``fq``), so with ``rtt_ms`` (0 included) a link is two TAP devices and ``delay_line`` carries the
frames between them, each ``rtt_ms / 4`` late in each direction: a host's upload, then the receiver's
download, so any two hosts are ``rtt_ms`` apart there and back; those links have an MTU of 9000 bytes
(fewer frames for the delay line to carry). No loss is added, beyond what a full queue drops. Everything
made here is named after this process's id and removed on exit, also after an error or an interruption;
names left by a killed run are removed by ``remove_leftovers``.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

from benchmarks.delay_line import open_tap

SUBNET = "10.213.0"
PREFIX = "swl"
DELAYED_MTU = 9000


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

    def __init__(
        self, hosts: int, mbit: float, rtt_ms: float | None = None, sysctls: dict[str, str] | None = None
    ) -> None:
        if not 1 <= hosts <= 250 or mbit <= 0 or (rtt_ms is not None and not 0 <= rtt_ms <= 10_000):
            raise ValueError("hosts must be in [1, 250], mbit > 0 and rtt_ms in [0, 10000]")
        self.hosts, self.mbit, self.rtt_ms, self.sysctls = hosts, mbit, rtt_ms, dict(sysctls or {})
        self._delay_line: subprocess.Popen | None = None
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

    def delay_line_cpu_s(self) -> float | None:
        """CPU seconds the delay line has used so far (None without one): what it took from the hosts."""
        if self._delay_line is None:
            return None
        fields = Path(f"/proc/{self._delay_line.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime

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
            pairs = []
            for i, (ns, host_end) in enumerate(zip(self.namespaces, self.host_ends, strict=True)):
                _ip("netns", "add", ns)
                self._made.append(("netns", ns))
                inner = f"{host_end}x"
                if self.rtt_ms is None:
                    _ip("link", "add", host_end, "type", "veth", "peer", "name", inner)
                    self._made.append(("link", host_end))
                else:  # the delay line's TAP pair, alive while its descriptors are
                    pairs.append((open_tap(inner), open_tap(host_end)))
                    for dev in (inner, host_end):
                        _ip("link", "set", dev, "mtu", str(DELAYED_MTU))
                _ip("link", "set", inner, "netns", ns)
                _ip("netns", "exec", ns, "ip", "link", "set", inner, "name", "eth0")
                _ip("netns", "exec", ns, "ip", "addr", "add", f"{self.address(i)}/24", "dev", "eth0")
                _ip("netns", "exec", ns, "ip", "link", "set", "eth0", "up")
                _ip("netns", "exec", ns, "ip", "link", "set", "lo", "up")
                for key, value in self.sysctls.items():  # each namespace has its own network stack's
                    _ip("netns", "exec", ns, "sysctl", "-q", "-w", f"{key}={value}")
                _ip("link", "set", host_end, "master", self.bridge)
                _ip("link", "set", host_end, "up")
                self._shape("eth0", ns)  # what the host uploads
                self._shape(host_end)  # what it downloads
            if pairs:
                self._start_delay_line(pairs)
        except BaseException:
            self.close()
            raise
        return self

    def _start_delay_line(self, pairs: list[tuple[int, int]]) -> None:
        """``delay_line`` with the TAP descriptors, which this process then closes: the devices live as long
        as the delay line does, and it as long as we hold its stdin."""
        fds = [fd for pair in pairs for fd in pair]
        try:
            cmd = [sys.executable, str(Path(__file__).with_name("delay_line.py")),
                   "--delay-ms", f"{self.rtt_ms / 4:g}", "--pairs", *(f"{a},{b}" for a, b in pairs)]  # fmt: skip
            self._delay_line = subprocess.Popen(
                cmd, stdin=subprocess.PIPE, pass_fds=fds, start_new_session=True
            )
        finally:
            for fd in fds:
                os.close(fd)

    def close(self) -> None:
        """Remove everything made, newest first (deleting a namespace deletes the veth pair in it; stopping
        the delay line, its TAP devices)."""
        if self._delay_line is not None:
            self._delay_line.stdin.close()  # it stops at EOF
            try:
                self._delay_line.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._delay_line.kill()
                self._delay_line.wait()
            self._delay_line = None
        while self._made:
            kind, name = self._made.pop()
            if kind == "netns":
                _ip("netns", "delete", name, check=False)
            else:
                _ip("link", "delete", name, check=False)

    def __exit__(self, *exc) -> None:
        self.close()
