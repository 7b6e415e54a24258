"""metrics.jsonl: written a line at a time, read while a peer is still writing it."""

from swarm.train.metrics_log import MetricsLog, read_metrics


def test_a_line_counts_once_its_newline_is_written(tmp_path):
    path = tmp_path / "metrics.jsonl"
    log = MetricsLog(path)
    log.write(step=1, loss=2.5)
    log.write(step=2, loss=float("nan"))
    with open(path, "a", encoding="utf-8") as fh:  # a line as a reader sees it mid-write, or cut by a kill
        fh.write('{"step": 3, "loss": 2.')
    records = read_metrics(path)
    assert [(r["step"], r["loss"]) for r in records] == [(1, 2.5), (2, "nan")]
    assert all(isinstance(r["time"], float) for r in records)
    # a resumed run drops the cut line and what came after its checkpoint, then writes on
    assert log.truncate_after(1) == 2
    log.write(step=2, loss=2.25)
    log.close()
    assert [(r["step"], r["loss"]) for r in read_metrics(path)] == [(1, 2.5), (2, 2.25)]
