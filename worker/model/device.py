"""Which device the worker's model and KV cache live on."""

from __future__ import annotations

import argparse
import importlib.util
import logging

import torch

from common.cli_types import device_spec

log = logging.getLogger(__name__)

_NO_GPU_HINT = ("a CPU-only torch build, no NVIDIA driver, CUDA_VISIBLE_DEVICES set to none, or a "
                "container started without --gpus")


def cupy_installed() -> bool:
    """True when CuPy can be imported (located, not imported: importing it initializes CUDA)."""
    return importlib.util.find_spec("cupy") is not None


def resolve_device(spec: str) -> torch.device:
    """Turn the ``--device`` setting into a torch device.

    Args:
        spec: ``"auto"``: the first visible CUDA GPU when torch sees one and CuPy
            (the CUDA kernels' launcher, the ``gpu`` extra) is installed, else
            the CPU, as vLLM detects its platform; ``"cpu"``; ``"cuda"``;
            ``"cuda:N"``. Pick among several GPUs with ``CUDA_VISIBLE_DEVICES``,
            as with vLLM, or with ``cuda:N``. The current CUDA device is left
            alone: every op and kernel launch takes its device from its tensors.

    Returns:
        The device (``cuda`` comes back as ``cuda:0``).

    Raises:
        ValueError: a misspelt spec; a CUDA device asked for while torch sees no
            GPU, or without CuPy; an index past the visible GPUs.
    """
    try:
        text = device_spec(spec)
    except argparse.ArgumentTypeError as exc:
        raise ValueError(f"device {exc}") from None
    if text == "auto":
        text = "cuda" if torch.cuda.is_available() and cupy_installed() else "cpu"
        if text == "cpu" and torch.cuda.is_available():
            log.warning("a CUDA GPU is visible but CuPy is not installed (pip install "
                        "'inflight-serve[gpu]'): serving from the CPU")
    if text == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ValueError(f"device {spec!r} asked for, but torch {torch.__version__} sees no CUDA GPU "
                         f"({_NO_GPU_HINT}); use --device cpu")
    if not cupy_installed():
        raise ValueError(f"device {spec!r} needs CuPy for the CUDA kernels: pip install the CuPy wheel of "
                         f"your CUDA version (cupy-cuda12x or cupy-cuda13x), or use --device cpu")
    device = torch.device(text)
    index = device.index or 0
    if index >= torch.cuda.device_count():
        raise ValueError(f"device {spec!r}: only {torch.cuda.device_count()} CUDA GPU(s) visible")
    return torch.device("cuda", index)


def describe(device: torch.device) -> str:
    """``"cpu"`` or ``"cuda:0 (NVIDIA H200)"``, for logs."""
    if device.type != "cuda":
        return str(device)
    return f"{device} ({torch.cuda.get_device_name(device)})"
