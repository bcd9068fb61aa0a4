"""Load a Llama-family model from a GGUF file (llama.cpp's format) into HF layout.

Weights are dequantized to float32 with ``gguf.quants.dequantize`` and renamed
to Hugging Face Llama names. llama.cpp's converter (convert_hf_to_gguf.py,
``LlamaModel.permute``) reorders the rows of ``q_proj``/``k_proj`` for its
interleaved (GPT-J style) RoPE; for arch ``llama`` we undo that so one code
path with HF's ``rotate_half`` serves GGUF and safetensors alike. Arch
``qwen2`` is stored unpermuted (NeoX RoPE in llama.cpp).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from worker.model.model_config import ModelConfig

PERMUTED_ARCHS = frozenset({"llama"})
SUPPORTED_ARCHS = frozenset({"llama", "qwen2"})
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_TOP_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def load_gguf(path: Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Read config and float32 weights (HF names, HF row order) from a GGUF file.

    Raises:
        ValueError: unsupported architecture, RoPE scaling, or unknown tensor.
    """
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    meta = {name: field.contents() for name, field in reader.fields.items()
            if not name.startswith(("GGUF.", "tokenizer.ggml."))}
    config = gguf_config(meta, path)
    weights = {}
    for tensor in reader.tensors:
        name = _hf_name(tensor.name)
        weights[name] = _unpermute(torch.from_numpy(_dequantize(tensor)), name, config, meta["general.architecture"])
    if "model.embed_tokens.weight" not in weights:
        raise ValueError(f"{path.name}: no token_embd.weight tensor")
    tied = "lm_head.weight" not in weights  # llama.cpp omits output.weight when tied
    return replace(config, vocab_size=weights["model.embed_tokens.weight"].shape[0], tie_word_embeddings=tied), weights


def gguf_config(meta: dict, path: Path) -> ModelConfig:
    """:class:`ModelConfig` from GGUF metadata (``{arch}.*`` keys).

    Raises:
        ValueError: unsupported architecture or RoPE scaling type.
    """
    arch = meta.get("general.architecture")
    if arch not in SUPPORTED_ARCHS:
        raise ValueError(f"{path.name}: architecture {arch!r} unsupported (supported: {sorted(SUPPORTED_ARCHS)})")
    scaling = meta.get(f"{arch}.rope.scaling.type")
    if scaling not in (None, "none"):
        raise ValueError(f"{path.name}: RoPE scaling {scaling!r} unsupported")
    hidden, heads = int(meta[f"{arch}.embedding_length"]), int(meta[f"{arch}.attention.head_count"])
    head_dim = int(meta.get(f"{arch}.attention.key_length", hidden // heads))
    rope_dim = int(meta.get(f"{arch}.rope.dimension_count", head_dim))
    if rope_dim != head_dim:
        raise ValueError(f"{path.name}: partial RoPE ({rope_dim} of {head_dim} dims) unsupported")
    return ModelConfig(
        hidden_size=hidden,
        num_layers=int(meta[f"{arch}.block_count"]),
        num_heads=heads,
        num_kv_heads=int(meta.get(f"{arch}.attention.head_count_kv", heads)),
        head_dim=head_dim,
        intermediate_size=int(meta[f"{arch}.feed_forward_length"]),
        vocab_size=int(meta.get(f"{arch}.vocab_size", 0)),  # 0: taken from token_embd by load_gguf
        rope_theta=float(meta.get(f"{arch}.rope.freq_base", 10000.0)),
        rms_norm_eps=float(meta.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        context_length=_context_length(meta, arch),
        tie_word_embeddings=False,  # load_gguf sets it from the tensors present
        attention_bias=arch == "qwen2",
    )


def _context_length(meta: dict, arch: str) -> int:
    """``{arch}.context_length`` (default 2048), capped at ``{arch}.attention.sliding_window``
    when present: sliding-window attention is not implemented (see
    :func:`worker.model.safetensors_loader.hf_config`)."""
    trained = int(meta.get(f"{arch}.context_length", 2048))
    window = int(meta.get(f"{arch}.attention.sliding_window", 0) or 0)
    return min(trained, window) if window > 0 else trained


def _dequantize(tensor) -> np.ndarray:
    from gguf.quants import dequantize

    # GGUF shapes are innermost-first; dequantize returns the row-major [out, in] array.
    array = np.ascontiguousarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
    return array if array.flags.writeable else array.copy()  # F32 tensors come back as read-only mmap views


def _hf_name(name: str) -> str:
    if name in _TOP_NAMES:
        return _TOP_NAMES[name]
    parts = name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}"
    raise ValueError(f"unknown GGUF tensor {name!r}")


def _unpermute(weight: torch.Tensor, name: str, config: ModelConfig, arch: str) -> torch.Tensor:
    """Inverse of llama.cpp's ``permute(w, n_head)``: rows (n_head, head_dim/2, 2) -> (n_head, 2, head_dim/2)."""
    if arch not in PERMUTED_ARCHS:
        return weight
    if ".q_proj." in name:
        heads = config.num_heads
    elif ".k_proj." in name:
        heads = config.num_kv_heads
    else:
        return weight
    shape = weight.shape
    return weight.reshape(heads, shape[0] // heads // 2, 2, *shape[1:]).transpose(1, 2).reshape(shape).contiguous()
