"""Fixtures of the command-line tests."""
from __future__ import annotations

import gc

import pytest


@pytest.fixture(autouse=True)
def _collect_earlier_tests_garbage() -> None:
    """Collect garbage before each test, before ``capsys`` starts: an earlier test's unclosed
    event-loop tasks (grpc.aio's request iterators) log "Task was destroyed but it is pending!"
    to stderr when collected, which landed in a CLI test's captured stderr in the full suite
    and broke its one-line assertion."""
    gc.collect()
