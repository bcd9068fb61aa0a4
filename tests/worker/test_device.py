"""``--device``: auto picks CUDA only when torch sees a GPU; a CUDA device asked
for on a machine without one is a clear ValueError, not a crash at first use."""

from __future__ import annotations

import pytest
import torch

from worker.device import resolve_device


def test_auto_and_cpu_resolve_to_the_cpu_without_a_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == torch.device("cpu")
    assert resolve_device(" CPU ") == torch.device("cpu")


@pytest.mark.parametrize("spec", ["cuda", "cuda:0"])
def test_cuda_without_a_gpu_names_the_fix(monkeypatch, spec):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="--device cpu"):
        resolve_device(spec)


@pytest.mark.parametrize("spec", ["gpu", "cuda:x", "mps", ""])
def test_unknown_specs_are_rejected(spec):
    with pytest.raises(ValueError, match="auto, cpu, cuda"):
        resolve_device(spec)


def test_cuda_index_is_checked_and_made_current(monkeypatch):
    chosen = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    assert resolve_device("auto") == torch.device("cuda", 0)
    assert resolve_device("cuda:1") == torch.device("cuda", 1)
    assert chosen == [0, 1]
    with pytest.raises(ValueError, match="only 2 CUDA GPU"):
        resolve_device("cuda:2")
