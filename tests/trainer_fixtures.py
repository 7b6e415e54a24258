"""Shared pieces of the trainer tests: the tiny config file (a module-scoped fixture, registered by
``pytest_plugins`` in conftest.py) the arguments of a solo run, and the losses a run logged."""

import pytest
import yaml

from swarm.train.metrics_log import read_metrics
from tests.conftest import TINY_CONFIG


def _solo_args(config, run_dir, *args: str) -> list[str]:
    return ["--config", str(config), "--solo", "--run-dir", str(run_dir), *args]


def _losses(run_dir):
    return {r["step"]: r["loss"] for r in read_metrics(run_dir / "metrics.jsonl") if "loss" in r}


@pytest.fixture(scope="module")
def config(tmp_path_factory, tiny_data):
    """The tiny config (as ``tiny_config`` writes it), shared by the module's runs."""
    path = tmp_path_factory.mktemp("config") / "tiny.yaml"
    path.write_text(yaml.safe_dump({**TINY_CONFIG, "data": {**TINY_CONFIG["data"], "path": str(tiny_data)}}))
    return path
