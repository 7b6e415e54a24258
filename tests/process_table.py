"""The machine's processes as /proc shows them: what the tests that start real processes check they stopped."""

import contextlib
from pathlib import Path


def processes() -> dict[int, tuple[int, int]]:
    """``{pid: (parent pid, session id)}`` of every process."""
    out = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
                out[int(d.name)] = (int(fields[1]), int(fields[3]))
    return out


def alive(pid: int) -> bool:
    """Whether ``pid`` runs: a zombie waiting to be reaped counts as gone (it holds no descriptors)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
