"""ImportAhead: a module imported on a thread, waited for before anything else imports it."""

import subprocess
import sys

from swarm.train.import_ahead import ImportAhead
from tests.conftest import ROOT

# In a fresh interpreter torch._dynamo is not imported yet: the ahead import runs while the main thread goes
# on, and torch._inductor (which imports torch._dynamo and is imported by it, as torch.compile does) only
# once wait() says the first import ended. Without the wait the two imports deadlock and one raises.
AFTER_WAIT = """
import torch
from swarm.train.import_ahead import ImportAhead
ahead = ImportAhead("torch._dynamo")
assert ahead.wait(timeout=240), "import still running"
assert ahead.error is None, ahead.error
import torch._inductor.utils
print("imported")
"""


def test_an_import_waited_for_lets_the_module_it_shares_locks_with_import():
    out = subprocess.run(
        [sys.executable, "-c", AFTER_WAIT], cwd=ROOT, capture_output=True, text=True, timeout=280
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["imported"]


def test_a_failed_import_is_kept_for_the_caller_not_raised_on_the_thread():
    ahead = ImportAhead("swarm.no_such_module")
    assert ahead.wait(timeout=30)
    assert isinstance(ahead.error, ModuleNotFoundError)
    assert "swarm.no_such_module" in str(ahead.error)


def test_a_module_already_imported_ends_at_once():
    ahead = ImportAhead("json")
    assert ahead.wait(timeout=5)
    assert ahead.error is None
