"""``--device``: auto picks CUDA only when torch sees a GPU and CuPy is there; a
CUDA device asked for where it cannot run is a clear ValueError, not a crash at
the first kernel launch; misspellings fail in argparse."""

from __future__ import annotations

import argparse

import pytest
import torch

from common.cli_types import device_spec
from worker.model import device as d
from worker.model.device import resolve_device


@pytest.fixture()
def gpu_machine(monkeypatch):
    """torch sees two GPUs; CuPy presence is up to the test."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(d, "cupy_installed", lambda: True)


def test_auto_and_cpu_resolve_to_the_cpu_without_a_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == torch.device("cpu")
    assert resolve_device(" CPU ") == torch.device("cpu")


@pytest.mark.parametrize("spec", ["cuda", "cuda:0"])
def test_cuda_without_a_gpu_names_the_fix(monkeypatch, spec):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="--device cpu"):
        resolve_device(spec)


@pytest.mark.parametrize("spec", ["gpu", "cuda:x", "cuda:²", "mps", ""])
def test_misspelt_specs_are_rejected_without_touching_cuda(spec):
    with pytest.raises(ValueError, match="auto, cpu, cuda"):
        resolve_device(spec)
    with pytest.raises(argparse.ArgumentTypeError):
        device_spec(spec)


def test_gpu_indices_are_checked(gpu_machine):
    assert resolve_device("auto") == torch.device("cuda", 0)
    assert resolve_device("cuda") == torch.device("cuda", 0)
    assert resolve_device("CUDA:1") == torch.device("cuda", 1)
    with pytest.raises(ValueError, match="only 2 CUDA GPU"):
        resolve_device("cuda:2")


def test_a_gpu_without_cupy_serves_from_the_cpu_on_auto_and_refuses_cuda(gpu_machine, monkeypatch, caplog):
    monkeypatch.setattr(d, "cupy_installed", lambda: False)
    assert resolve_device("auto") == torch.device("cpu")
    assert "CuPy is not installed" in caplog.text
    with pytest.raises(ValueError, match="needs CuPy"):
        resolve_device("cuda")


def test_resolving_leaves_the_current_cuda_device_alone(gpu_machine, monkeypatch):
    monkeypatch.setattr(torch.cuda, "set_device", lambda *_: pytest.fail("set_device called"))
    resolve_device("cuda:1")


def test_build_engine_loads_the_model_on_the_resolved_device(monkeypatch, tmp_path):
    """The GPU image once served from the CPU: build_engine never passed a device on."""
    import worker.serve.main
    from bench.tiny import ByteTokenizer
    from worker.model.model_runner import tiny_random_runner
    from worker.serve.settings import WorkerSettings

    chosen, loaded = object(), {}

    def fake_load(path, **kwargs):
        loaded.update(kwargs)
        return tiny_random_runner()

    monkeypatch.setattr(worker.serve.main, "resolve_model_path", lambda spec: tmp_path)
    monkeypatch.setattr(worker.serve.main, "load_tokenizer", lambda path: ByteTokenizer())
    monkeypatch.setattr(worker.serve.main, "resolve_device", lambda spec: chosen if spec == "cuda:1" else None)
    monkeypatch.setattr(worker.serve.main, "describe", str)
    monkeypatch.setattr(worker.serve.main, "load_model_runner", fake_load)
    worker.serve.main.build_engine(WorkerSettings(device="cuda:1"))
    assert loaded["device"] is chosen
