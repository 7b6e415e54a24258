"""``metrics.jsonl``: one JSON object per line (with its wall time, ``time``), flushed as written so a crash
loses at most one line."""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import Any


def _clean(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # JSON has no NaN/inf; keep the information as text
    return value


class MetricsLog:
    """Append-only metrics file of a run directory.

    ``log = MetricsLog(run_dir / "metrics.jsonl"); log.write(step=10, loss=3.2)``.
    ``truncate_after(step)`` drops records past a checkpoint when a run resumes, so the file describes
    one consistent history.
    """

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fh = open(self.path, "a", encoding="utf-8")

    def write(self, **record: Any) -> None:
        """One record; ``time`` (Unix seconds) is added, so that peers' records can be lined up."""
        record = {**record, "time": round(time.time(), 3)} if "time" not in record else record
        self._fh.write(json.dumps({k: _clean(v) for k, v in record.items()}) + "\n")
        self._fh.flush()

    def truncate_after(self, step: int) -> int:
        """Keep only records with ``step <= step`` (atomic rewrite). Returns how many were dropped."""
        self._fh.close()
        kept, dropped = [], 0
        for line in self.path.read_text(encoding="utf-8").splitlines():
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:  # a line cut by a kill: drop it
                dropped += 1
                continue
            if isinstance(rec, dict) and rec.get("step", -1) <= step:
                kept.append(line)
            else:
                dropped += 1
        tmp = self.path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(line + "\n" for line in kept), encoding="utf-8")
        os.replace(tmp, self.path)
        self._fh = open(self.path, "a", encoding="utf-8")
        return dropped

    def close(self) -> None:
        self._fh.close()


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """The records of a metrics file, also one that a peer is writing: a line counts once its newline is
    in, so a line still being written (or cut by a kill) is left out, not read as malformed JSON."""
    lines = Path(path).read_text(encoding="utf-8").split("\n")[:-1]  # the piece after the last newline
    return [json.loads(line) for line in lines if line.strip()]
