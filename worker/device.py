"""Which device the worker's model and KV cache live on."""

from __future__ import annotations

import torch

DEVICE_CHOICES = ("auto", "cpu", "cuda")


def resolve_device(spec: str) -> torch.device:
    """Turn the ``--device`` setting into a torch device.

    Args:
        spec: ``"auto"`` (the first CUDA GPU when torch sees one, else the CPU,
            as vLLM's default device detection does), ``"cpu"``, ``"cuda"`` or
            ``"cuda:N"``.

    Returns:
        The device. A CUDA device is then also torch's current device, so that
        the kernels (``kernels.cuda_ops``) launch on it.

    Raises:
        ValueError: an unknown spec, a CUDA device asked for while torch sees
            none (a CPU-only torch build, or no driver), or an index past the
            visible GPUs.
    """
    text = spec.strip().lower()
    if text == "auto":
        text = "cuda" if torch.cuda.is_available() else "cpu"
    if text == "cpu":
        return torch.device("cpu")
    if text != "cuda" and not (text.startswith("cuda:") and text[5:].isdigit()):
        raise ValueError(f"device {spec!r} is not one of auto, cpu, cuda, cuda:N")
    if not torch.cuda.is_available():
        raise ValueError(f"device {spec!r} asked for, but torch {torch.__version__} sees no CUDA GPU "
                         f"(a CPU-only torch build, or no NVIDIA driver); use --device cpu")
    device = torch.device(text)
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index >= torch.cuda.device_count():
        raise ValueError(f"device {spec!r}: only {torch.cuda.device_count()} CUDA GPU(s) visible")
    torch.cuda.set_device(index)
    return torch.device("cuda", index)
