"""The results of ``swarm-eval`` as JSON and as a markdown table.

Usage::

    write_reports(out_dir, results)      # out_dir/results.json and out_dir/results.md
    print(markdown_table(results))

``results`` holds ``tasks`` (from ``harness.collect_metrics``), ``validation`` (from ``val_bpb``, or None)
and provenance (model, step, limit, the equivalent lm-eval command).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def _fmt(value: float | None) -> str:
    return "" if value is None else f"{value:.4f}"


def markdown_table(results: dict[str, Any]) -> str:
    """One row per task (accuracy columns, documents used / available) plus the validation bpb row."""
    lines = [
        "| task | shots | docs | acc | acc_norm | other |",
        "|---|---:|---:|---:|---:|---|",
    ]
    for task, row in results["tasks"].items():
        other = f"perplexity {row['perplexity']:.4g}" if "perplexity" in row else ""
        docs = f"{row['n']}/{row['n_total']}"
        lines.append(
            f"| {task} | {row['num_fewshot']} | {docs} | {_fmt(row.get('acc'))} | {_fmt(row.get('acc_norm'))} | {other} |"
        )
    val = results.get("validation")
    if val:
        lines.append(
            f"| held-out validation shard | | {val['tokens']:,} tokens | | | "
            f"bpb {val['bpb']:.4f}, loss {val['loss']:.4f} nats/token |"
        )
    return "\n".join(lines)


def write_reports(out_dir: Path, results: dict[str, Any]) -> tuple[Path, Path]:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    js, md = out_dir / "results.json", out_dir / "results.md"
    js.write_text(json.dumps(results, indent=1) + "\n")
    head = [
        f"# swarm-eval: {results['model']}",
        "",
        f"- weights: {results.get('source') or results['model']}"
        + (f", step {results['step']}" if results.get("step") is not None else ""),
        f"- lm-eval {results['lm_eval_version']}, data {results['data_source']}, "
        f"limit {results['limit'] if results['limit'] is not None else 'none (every document)'}",
        f"- same numbers: `{results['command']}`",
        "",
    ]
    md.write_text("\n".join(head) + markdown_table(results) + "\n")
    return js, md
