"""Fixtures shared by the worker's tests."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="module")
def one_torch_thread():
    """Torch on one thread for a module's tests: models this small run fastest so, and on a
    shared machine OpenMP threads waiting at barriers made such files up to 20x slower. Use it
    with ``pytestmark = pytest.mark.usefixtures("one_torch_thread")``."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
