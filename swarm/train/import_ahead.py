"""Import a slow module on a thread while the caller waits for something else, and wait for that import to
end before running anything that may import the module too.

    ahead = ImportAhead("torch._dynamo")  # seconds of CPU, overlapped with the expert claim's wait
    claim_experts(...)
    ahead.wait(timeout=120)               # before torch.compile or the optimizer's first param group
    trainer.setup(...)

Why the wait matters: ``torch._dynamo`` and ``torch._inductor`` import each other. A thread importing one
while another thread imports the other deadlocks on Python's module locks, and Python breaks the deadlock
by raising ``ImportError`` (``_DeadlockError``) in one of them, so the second import must not begin before
the first has ended. A swarm peer on an H200 died of it in ``model.compile()``.
"""

from __future__ import annotations

import importlib
import threading


class ImportAhead:
    """``importlib.import_module(name)`` on a daemon thread, started at once. ``wait`` blocks until it has
    ended (or ``timeout`` seconds), and ``error`` holds what the import raised, if anything (the module is
    then imported again, with its error, by whoever needs it)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=f"import {name}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            importlib.import_module(self.name)
        except BaseException as e:  # noqa: BLE001 - kept for the caller; a thread has no one to raise to
            self.error = e

    def wait(self, timeout: float) -> bool:
        """Whether the import has ended (with or without an error) within ``timeout`` seconds."""
        self._thread.join(timeout)
        return not self._thread.is_alive()
