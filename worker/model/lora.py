"""LoRA adapters (Hu et al. 2021) read from PEFT's directory format and mapped onto the
decoder's fused projections.

A PEFT adapter directory holds ``adapter_config.json`` (``r``, ``lora_alpha``,
``target_modules``, ``use_rslora``, ``base_model_name_or_path`` ...) and
``adapter_model.safetensors`` with, per targeted module, ``lora_A.weight`` ``[r, in]`` and
``lora_B.weight`` ``[out, r]`` under HF names (``base_model.model.model.layers.{i}.self_attn.q_proj...``).
The adapted module computes ``x @ W.T + scaling * (x @ A.T) @ B.T`` with ``scaling =
lora_alpha / r`` (``lora_alpha / sqrt(r)`` with rsLoRA, Kalajdzievski 2023).

The decoder fuses q/k/v into one ``qkv`` projection and gate/up into ``gate_up``
(:class:`worker.model.llama.LayerWeights`): each adapted module keeps its own ``A`` and
``B`` (:class:`LoraModule`, the scaling folded into ``B``) and knows its slice of the fused
output (:func:`module_slices`); :mod:`worker.model.lora_batch` stacks the modules of one
fused projection so one shrink GEMM serves them all, and each module's expand writes its own
output columns. Phi-3 style fused modules (``qkv_proj``, ``gate_up_proj``) map onto the whole
projection.

Refused at load (``ValueError`` naming why): a rank above ``max_lora_rank``, a target module
the decoder has no LoRA for (anything but the attention and MLP projections: ``lm_head``,
``embed_tokens`` ...), DoRA, ``modules_to_save``, per-module ``rank_pattern``/``alpha_pattern``,
trained biases, a ``lora_alpha`` that is not a finite number (or whose scaling takes ``B``
beyond the compute dtype's range), tensors holding NaN or infinite values, an adapter whose ``base_model_name_or_path`` clearly names another model than the
worker's (:mod:`worker.model.lora_base`: compared only when both sides are known), and tensors
whose shapes or layer indices do not fit this model (an adapter trained for another base model;
the message names its ``base_model_name_or_path``).
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from worker.model.lora_base import ModelIdentity, check_base_model
from worker.model.model_config import ModelConfig

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
#: The decoder's fused projections that take LoRA, in layer order.
PROJECTIONS: tuple[str, ...] = ("qkv", "o", "gate_up", "down")
_KEY = re.compile(r"^(?:base_model\.model\.)?(?:model\.)?layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)"
                  r"\.lora_([AB])(?:\.[A-Za-z0-9_]+)?\.weight$")


@dataclass(frozen=True)
class LoraModule:
    """One adapted module's LoRA in one layer.

    Attributes:
        a_t: ``[in, r]`` ``lora_A`` transposed, in the model's compute dtype.
        b_t: ``[r, out_m]`` ``scaling * lora_B`` transposed (``out_m``: the module's own outputs,
            a slice of its fused projection's), same dtype.
    """

    a_t: torch.Tensor
    b_t: torch.Tensor


@dataclass(frozen=True)
class LoraAdapter:
    """An adapter ready for the batched product (:mod:`worker.model.lora_batch`).

    Attributes:
        name: the served name (``--lora-modules name=path``).
        path: its directory.
        rank: ``r`` of its config.
        scaling: ``lora_alpha / r`` (rsLoRA: ``lora_alpha / sqrt(r)``), folded into every ``b_t``.
        modules: the HF module names it adapts, in :func:`module_slices` order; every layer
            has each (zeros in the layers the adapter leaves out).
        layers: per decoder layer, module name → :class:`LoraModule`.
        digest: BLAKE2b of the weights file and config, hex: the adapter's identity in block hashes.
    """

    name: str
    path: str
    rank: int
    scaling: float
    modules: tuple[str, ...]
    layers: list[dict[str, LoraModule]]
    digest: str

    @property
    def nbytes(self) -> int:
        """Bytes its tensors hold."""
        return sum(t.numel() * t.element_size() for layer in self.layers for p in layer.values()
                   for t in (p.a_t, p.b_t))


def module_slices(cfg: ModelConfig) -> dict[str, tuple[str, int, int, int]]:
    """Each HF module name that may carry LoRA → ``(projection, out_start, out_end, in_features)``
    in the decoder's fused layout."""
    q, kv, h, inter = cfg.q_size, cfg.kv_size, cfg.hidden_size, cfg.intermediate_size
    return {
        "q_proj": ("qkv", 0, q, h), "k_proj": ("qkv", q, q + kv, h), "v_proj": ("qkv", q + kv, q + 2 * kv, h),
        "qkv_proj": ("qkv", 0, q + 2 * kv, h), "o_proj": ("o", 0, h, q),
        "gate_proj": ("gate_up", 0, inter, h), "up_proj": ("gate_up", inter, 2 * inter, h),
        "gate_up_proj": ("gate_up", 0, 2 * inter, h), "down_proj": ("down", 0, h, inter),
    }


def read_adapter_config(path: str | Path) -> dict:
    """The adapter's ``adapter_config.json``.

    Raises:
        FileNotFoundError: ``path`` is not a directory with both PEFT files.
        ValueError: the config is not a JSON object.
    """
    folder = Path(path)
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        if not (folder / name).is_file():
            raise FileNotFoundError(f"LoRA adapter {str(folder)!r} has no {name} (PEFT's format: "
                                    f"{CONFIG_FILE} + {WEIGHTS_FILE})")
    try:
        config = json.loads((folder / CONFIG_FILE).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"LoRA adapter {str(folder)!r}: {CONFIG_FILE} is not readable JSON: {exc}") from exc
    if not isinstance(config, dict):
        raise ValueError(f"LoRA adapter {str(folder)!r}: {CONFIG_FILE} is not a JSON object")
    return config


def check_adapter_config(config: dict, max_lora_rank: int, where: str) -> tuple[int, float]:
    """``(rank, scaling)`` of a PEFT LoRA config, or ValueError naming what this server refuses."""
    if config.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{where}: peft_type {config.get('peft_type')!r} is not a LoRA adapter")
    rank = config.get("r")
    if not isinstance(rank, int) or rank < 1:
        raise ValueError(f"{where}: r must be a positive integer, got {rank!r}")
    if rank > max_lora_rank:
        raise ValueError(f"{where}: rank {rank} exceeds --max-lora-rank {max_lora_rank}")
    for key, why in (("use_dora", "DoRA"), ("modules_to_save", "modules_to_save (whole modules trained)"),
                     ("rank_pattern", "per-module ranks (rank_pattern)"),
                     ("alpha_pattern", "per-module alphas (alpha_pattern)"), ("fan_in_fan_out", "fan_in_fan_out")):
        if config.get(key):
            raise ValueError(f"{where}: {why} is not supported")
    if config.get("bias", "none") != "none":
        raise ValueError(f"{where}: trained biases (bias={config['bias']!r}) are not supported")
    alpha = config.get("lora_alpha", rank)
    try:
        finite = not isinstance(alpha, bool) and isinstance(alpha, (int, float)) and math.isfinite(float(alpha))
    except OverflowError:  # an integer beyond float range (math.isfinite converts it)
        finite = False
    if not finite:
        raise ValueError(f"{where}: lora_alpha must be a finite number, got {str(alpha)[:40]!r}")
    scaling = float(alpha) / math.sqrt(rank) if config.get("use_rslora") else float(alpha) / rank
    return rank, scaling


def load_adapter(name: str, path: str | Path, cfg: ModelConfig, max_lora_rank: int,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                 identity: ModelIdentity | None = None) -> LoraAdapter:
    """Read and check the PEFT adapter at ``path`` for a model of ``cfg`` named as ``identity``
    says (None: its base model's name is not compared); its tensors stacked per fused
    projection (module docstring) in ``dtype`` on ``device``.

    Raises:
        FileNotFoundError: not a PEFT adapter directory.
        ValueError: refused (module docstring): the message names the adapter and why.
    """
    from safetensors.torch import load_file

    where = f"LoRA adapter {name!r} ({str(path)})"
    config = read_adapter_config(path)
    rank, scaling = check_adapter_config(config, max_lora_rank, where)
    check_base_model(config, identity, where)
    base = config.get("base_model_name_or_path") or "unnamed"
    slices = module_slices(cfg)
    targets = config.get("target_modules")
    if isinstance(targets, list):
        lacking = sorted(str(t) for t in targets if str(t).split(".")[-1] not in slices)
        if lacking:
            raise ValueError(f"{where}: target modules {lacking} are not in this model's LoRA-capable "
                             f"projections {sorted(slices)}")
    weights_path = Path(path) / WEIGHTS_FILE
    try:
        tensors = load_file(str(weights_path))
    except Exception as exc:  # noqa: BLE001 - safetensors raises its own error types
        raise ValueError(f"{where}: {WEIGHTS_FILE} is not a readable safetensors file: {exc}") from exc
    found: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        if "lora_magnitude_vector" in key:
            raise ValueError(f"{where}: DoRA is not supported ({key})")
        match = _KEY.match(key)
        if match is None:
            raise ValueError(f"{where}: tensor {key!r} targets a module this model has no LoRA for "
                             f"(LoRA-capable: {sorted(slices)} of the decoder layers)")
        layer, module, side = int(match[1]), match[2], match[3]
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise ValueError(f"{where}: tensor {key!r} holds NaN or infinite values")
        if module not in slices:
            raise ValueError(f"{where}: target module {module!r} ({key}) is not in this model's LoRA-capable "
                             f"projections {sorted(slices)}")
        if layer >= cfg.num_layers:
            raise ValueError(f"{where}: tensor {key!r} is for layer {layer}, the model has {cfg.num_layers} "
                             f"layers: base model mismatch (the adapter was trained on {base!r})")
        found.setdefault((layer, module), {})[side] = tensor
    if not found:
        raise ValueError(f"{where}: {WEIGHTS_FILE} holds no lora_A/lora_B tensors")
    modules = _check_shapes(found, slices, rank, where, base)
    layers = _layers(cfg, found, modules, slices, rank, scaling, dtype, device, where)
    digest = hashlib.blake2b(weights_path.read_bytes() + json.dumps(config, sort_keys=True).encode(),
                             digest_size=16).hexdigest()
    return LoraAdapter(name, str(path), rank, scaling, tuple(modules), layers, digest)


def _check_shapes(found: dict, slices: dict, rank: int, where: str, base: str) -> list[str]:
    """The adapted module names, in :func:`module_slices` order, once every pair's shapes fit."""
    for (layer, module), pair in found.items():
        if set(pair) != {"A", "B"}:
            raise ValueError(f"{where}: layer {layer} {module} has lora_{''.join(pair)} without its pair")
        _, start, end, in_features = slices[module]
        want_a, want_b = (rank, in_features), (end - start, rank)
        if tuple(pair["A"].shape) != want_a or tuple(pair["B"].shape) != want_b:
            raise ValueError(f"{where}: layer {layer} {module} has lora_A {tuple(pair['A'].shape)} and lora_B "
                             f"{tuple(pair['B'].shape)}, this model needs {want_a} and {want_b}: base model "
                             f"mismatch (the adapter was trained on {base!r}) or a rank other than r={rank}")
    present = {module for _, module in found}
    fused_and_split = [(whole, parts) for whole, parts in (("qkv_proj", ("q_proj", "k_proj", "v_proj")),
                                                           ("gate_up_proj", ("gate_proj", "up_proj")))
                       if whole in present and present.intersection(parts)]
    if fused_and_split:
        raise ValueError(f"{where}: adapts {fused_and_split[0][0]} and its parts {fused_and_split[0][1]} both")
    return [m for m in slices if m in present]


def _layers(cfg: ModelConfig, found: dict, modules: list[str], slices: dict, rank: int, scaling: float,
            dtype: torch.dtype, device, where: str) -> list[dict[str, LoraModule]]:
    """Per layer, each adapted module's ``a_t`` ``[in, r]`` and scaled ``b_t`` ``[r, out_m]``
    (zeros in a layer the adapter leaves out).

    Raises:
        ValueError: the scaling takes a ``B`` value beyond ``dtype``'s range."""
    layers: list[dict[str, LoraModule]] = []
    for layer in range(cfg.num_layers):
        entry = {}
        for module in modules:
            _, start, end, in_features = slices[module]
            pair = found.get((layer, module))
            if pair is None:
                a_t, b_t = torch.zeros(in_features, rank), torch.zeros(rank, end - start)
            else:
                a_t, b_t = pair["A"].float().T, pair["B"].float().T * scaling
                if not bool(torch.isfinite(b_t.to(dtype)).all()):
                    raise ValueError(f"{where}: lora_alpha's scaling {scaling:g} takes layer {layer} {module}'s "
                                     f"lora_B beyond the range of {str(dtype).removeprefix('torch.')}")
            entry[module] = LoraModule(a_t.to(device=device, dtype=dtype).contiguous(),
                                       b_t.to(device=device, dtype=dtype).contiguous())
        layers.append(entry)
    return layers
