"""Load a Llama-family model from a GGUF file (llama.cpp's format) into HF layout.

Weights are dequantized to float32 with ``gguf.quants.dequantize`` and renamed
to Hugging Face Llama names; with ``--quantization gguf`` the K-quant tensors stay in
their blocks, views of the file's memory map (:mod:`worker.model.kquant`). llama.cpp's converter (convert_hf_to_gguf.py,
``LlamaModel.permute``) reorders the rows of ``q_proj``/``k_proj`` for its
interleaved (GPT-J style) RoPE; for arch ``llama`` we undo that so one code
path with HF's ``rotate_half`` serves GGUF and safetensors alike. Arch
``qwen2``, ``qwen3`` and ``phi3`` are stored unpermuted (NeoX RoPE in llama.cpp);
``phi3`` keeps its fused ``attn_qkv`` and a fused gate/up ``ffn_up``, and LongRoPE's
factor sets as the ``rope_factors_long``/``_short`` tensors (llama.cpp, like us,
takes the long set when the context exceeds the original one). Arch ``gemma2`` and
``gemma3`` (text; NeoX RoPE, unpermuted) add the sandwich norms ``post_attention_norm``
and ``post_ffw_norm`` (``ffn_norm`` is then the pre-feed-forward norm), Gemma 3's
``attn_q_norm``/``attn_k_norm``, and no ``output.weight`` (tied); llama.cpp's converter
stores every Gemma norm as ``1 + w``, so 1 is subtracted here for the decoder's (1 + w)
norms. What the header does not say is llama.cpp's too: Gemma 2 slides on every other
layer and Gemma 3 on five of six (``{arch}.attention.sliding_window`` wide), Gemma 3's
sliding layers use RoPE base 10000 without the file's (global) scaling, the 27B's
attention scale is 1/sqrt(hidden/heads); the soft-caps are ``{arch}.attn_logit_softcapping``
and ``{arch}.final_logit_softcapping``. A Mistral GGUF (arch ``llama``) slides on every
layer when it has ``llama.attention.sliding_window``.

Tensor types are checked before anything is dequantized: the float types and
the legacy and K quantizations (:data:`SUPPORTED_QUANT_TYPES`: ``Q4_K_M`` files
mix Q4_K and Q6_K, ``Q5_K_M`` Q5_K and Q6_K); the I-quants (``IQ4_XS`` too: no real file
of a supported family here to check it against) and ternary types are refused with the
supported list. Llama 3.1's llama3 RoPE scaling arrives as llama.cpp's ``rope_freqs``
tensor (one divisor per frequency), YaRN and linear scaling as ``{arch}.rope.scaling.*``
metadata.
"""

from __future__ import annotations

import functools
import warnings
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from common.progress import Progress
from worker.model.kquant import KQUANT_TYPES, KQuantWeight
from worker.model.model_config import ModelConfig
from worker.model.rope import RopeConfig

PERMUTED_ARCHS = frozenset({"llama"})
SUPPORTED_ARCHS = ("llama", "qwen2", "qwen3", "phi3", "gemma2", "gemma3")
GEMMA_ARCHS = frozenset({"gemma2", "gemma3"})
# llama.cpp's global-attention period of Gemma's layers (llama-model.cpp ``set_swa_pattern``),
# the block count of its 27B (whose attention scale is 1/sqrt(hidden/heads), not 1/sqrt(head_dim)),
# and Gemma 3's local RoPE base (``rope_freq_base_train_swa``): none of them is in the file
_GEMMA_SWA_PERIOD = {"gemma2": 2, "gemma3": 6}
_GEMMA_27B_BLOCKS = {"gemma2": 46, "gemma3": 62}
_GEMMA3_LOCAL_THETA = 10000.0
_ROPE_TENSORS = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")
SUPPORTED_QUANT_TYPES = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K",
                         "Q6_K")
SUPPORTED_ROPE_SCALING = ("none", "linear", "yarn")
_LAYER_NAMES = {
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
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
_GEMMA_NAMES = {  # sandwich norms: llama.cpp's ffn_norm is Gemma's pre-feed-forward norm
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
}
_PHI3_NAMES = {"attn_qkv.weight": "self_attn.qkv_proj.weight", "ffn_up.weight": "mlp.gate_up_proj.weight"}
_TOP_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def load_gguf(path: Path, keep_kquants: bool = False) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Read config and float32 weights (HF names, HF row order) from a GGUF file.

    With ``keep_kquants``, the 2-D tensors the file holds in K-quant blocks (Q2_K..Q6_K)
    come back as :class:`~worker.model.kquant.KQuantWeight` views of the file's memory map
    instead (``--quantization gguf``: nothing is dequantized or copied, but the q/k rows that
    llama.cpp reorders, which are copied once in HF order).

    Raises:
        ValueError: unsupported architecture, tensor type or RoPE scaling, or an
            unknown tensor; each message names the value and the supported list.
    """
    reader = gguf_reader(path)
    meta = {name: field.contents() for name, field in reader.fields.items()
            if not name.startswith(("GGUF.", "tokenizer.ggml."))}
    check_tensor_types(reader.tensors, path)
    rope = {t.name: tuple(_dequantize(t).reshape(-1).tolist()) for t in reader.tensors if t.name in _ROPE_TENSORS}
    config = gguf_config(meta, path, rope)
    weights = {}
    arch = meta["general.architecture"]
    with Progress(f"loading {path.name}", total=sum(int(t.n_bytes) for t in reader.tensors), unit="B") as progress:
        for tensor in reader.tensors:
            progress.advance(int(tensor.n_bytes))  # the tensor's bytes of the file, read below
            if tensor.name in _ROPE_TENSORS:
                continue
            name = _hf_name(tensor.name, arch)
            if keep_kquants and tensor.tensor_type.name.lower() in KQUANT_TYPES and len(tensor.shape) == 2:
                weights[name] = _unpermute_kquant(_kquant_weight(tensor), name, config, arch)
                continue
            weight = torch.from_numpy(_dequantize(tensor))
            if arch in GEMMA_ARCHS and name.endswith("norm.weight"):
                weight -= 1.0  # llama.cpp stores Gemma's 1 + w; the decoder adds the 1 itself (norm_plus_one)
            weights[name] = _unpermute(weight, name, config, arch)
    if "model.embed_tokens.weight" not in weights:
        raise ValueError(f"{path.name}: no token_embd.weight tensor")
    tied = "lm_head.weight" not in weights  # llama.cpp omits output.weight when tied
    return replace(config, vocab_size=weights["model.embed_tokens.weight"].shape[0], tie_word_embeddings=tied), weights


def gguf_tensor_formats(path: str | Path) -> dict[str, str]:
    """Each weight's storage type in the GGUF file at ``path``, by HF name, in lower case
    (``"q4_1"``, ``"q8_0"``, ``"f32"``, ``"q6_k"`` ...), read from the header only: what
    ``--quantization gguf`` keeps as blocks (:func:`worker.model.quantization.projection_format`).
    Parsing the header takes about 2 s for SmolLM2-135M (its tokenizer arrays), and a worker's
    start asks twice (``auto``'s choice, then the packing), so the answer is kept per path and
    modification time.

    Raises:
        FileNotFoundError: no file at ``path``.
        ValueError: an unknown tensor name (as :func:`load_gguf`)."""
    path = Path(path).resolve()
    return dict(_tensor_formats(str(path), path.stat().st_mtime_ns))


def gguf_reader(path: str | Path):
    """The shared parsed reader of the GGUF file at ``path`` (:func:`common.gguf_file.gguf_reader`):
    the tokenizer, the startup check, ``auto``'s choice, the tensor formats and the load all use
    one header parse.

    Raises:
        FileNotFoundError: no file at ``path``; ValueError: what ``GGUFReader`` raises on a bad
            file (:func:`worker.model.gguf_check.check_gguf_file` catches those first)."""
    from common.gguf_file import gguf_reader as shared_reader

    return shared_reader(path)


@functools.lru_cache(maxsize=4)
def _tensor_formats(path: str, mtime_ns: int) -> tuple[tuple[str, str], ...]:
    reader = gguf_reader(path)
    arch = reader.fields["general.architecture"].contents()
    return tuple((_hf_name(t.name, arch), t.tensor_type.name.lower()) for t in reader.tensors
                 if t.name not in _ROPE_TENSORS)


def check_tensor_types(tensors, path: Path) -> None:
    """Refuse a file holding a tensor type outside :data:`SUPPORTED_QUANT_TYPES`.

    Raises:
        ValueError: names the first such tensor, its type and the supported list.
    """
    for tensor in tensors:
        kind = tensor.tensor_type.name
        if kind not in SUPPORTED_QUANT_TYPES:
            raise ValueError(f"{path.name}: tensor {tensor.name!r} has type {kind}, unsupported "
                             f"(supported: {', '.join(SUPPORTED_QUANT_TYPES)})")


def _rope(meta: dict, arch: str, path: Path, tensors: dict[str, tuple[float, ...]], context: int) -> RopeConfig:
    """RoPE of a GGUF file: ``{arch}.rope.freq_base``, ``{arch}.rope.scaling.*`` and
    llama.cpp's ``rope_freqs`` divisors or ``rope_factors_long``/``_short`` (LongRoPE)."""
    theta = float(meta.get(f"{arch}.rope.freq_base", 10000.0))
    original = meta.get(f"{arch}.rope.scaling.original_context_length")
    if "rope_factors_long.weight" in tensors:
        attn = meta.get(f"{arch}.rope.scaling.attn_factor")
        return RopeConfig(theta=theta, rope_type="longrope", max_position_embeddings=context,
                          original_max_position_embeddings=int(original) if original else None,
                          short_factor=tensors.get("rope_factors_short.weight") or tensors["rope_factors_long.weight"],
                          long_factor=tensors["rope_factors_long.weight"],
                          attention_factor=float(attn) if attn else None)
    freq_factors = tensors.get("rope_freqs.weight", ())
    scaling = meta.get(f"{arch}.rope.scaling.type") or "none"
    if scaling not in SUPPORTED_ROPE_SCALING:
        raise ValueError(f"{path.name}: RoPE scaling {scaling!r} unsupported "
                         f"(supported: {', '.join(SUPPORTED_ROPE_SCALING)})")
    if scaling == "none":
        return RopeConfig(theta=theta, max_position_embeddings=context, freq_factors=freq_factors)
    factor = float(meta.get(f"{arch}.rope.scaling.factor", 1.0))
    return RopeConfig(theta=theta, rope_type=scaling, factor=factor, max_position_embeddings=context,
                      original_max_position_embeddings=int(original) if original else None)


def gguf_config(meta: dict, path: Path, rope_tensors: dict[str, tuple[float, ...]] | None = None) -> ModelConfig:
    """:class:`ModelConfig` from GGUF metadata (``{arch}.*`` keys); ``rope_tensors``:
    the file's ``rope_freqs`` / ``rope_factors_*`` tensors by name, if any.

    Raises:
        ValueError: unsupported architecture or RoPE scaling type (the message
            names the supported ones).
    """
    arch = meta.get("general.architecture")
    if arch not in SUPPORTED_ARCHS:
        raise ValueError(f"{path.name}: architecture {arch!r} unsupported (supported: {', '.join(SUPPORTED_ARCHS)})")
    context = int(meta.get(f"{arch}.context_length", 2048))
    rope = _rope(meta, arch, path, rope_tensors or {}, context)
    hidden, heads = int(meta[f"{arch}.embedding_length"]), int(meta[f"{arch}.attention.head_count"])
    head_dim = int(meta.get(f"{arch}.attention.key_length", hidden // heads))
    rope_dim = int(meta.get(f"{arch}.rope.dimension_count", head_dim))
    if rope_dim != head_dim:
        raise ValueError(f"{path.name}: partial RoPE ({rope_dim} of {head_dim} dims) unsupported")
    layers = int(meta[f"{arch}.block_count"])
    config = ModelConfig(
        hidden_size=hidden,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=int(meta.get(f"{arch}.attention.head_count_kv", heads)),
        head_dim=head_dim,
        intermediate_size=int(meta[f"{arch}.feed_forward_length"]),
        vocab_size=int(meta.get(f"{arch}.vocab_size", 0)),  # 0: taken from token_embd by load_gguf
        rope_theta=rope.theta,
        rms_norm_eps=float(meta.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        context_length=context,
        layer_windows=_layer_windows(meta, arch, layers),
        tie_word_embeddings=False,  # load_gguf sets it from the tensors present
        attention_bias=arch == "qwen2",
        architecture=arch,
        rope=rope,
        qk_norm=arch in ("qwen3", "gemma3"),
    )
    return _gemma(config, meta, arch) if arch in GEMMA_ARCHS else config


def _gemma(config: ModelConfig, meta: dict, arch: str) -> ModelConfig:
    """Gemma 2/3's numerics on top of the common fields, as :func:`worker.model.hf_config.hf_config`
    sets them from a ``config.json``: (1 + w) and sandwich norms, ``sqrt(hidden)`` embedding
    scale, tanh-GELU, Gemma 2's soft-caps (``{arch}.attn_logit_softcapping``,
    ``{arch}.final_logit_softcapping``), the 27B's ``query_pre_attn_scalar`` of hidden/heads
    (llama.cpp tells the 27B by its block count), and Gemma 3's local RoPE (base 10000 unless
    ``{arch}.rope.freq_base_swa``; the file's scaling is the global layers' only)."""
    attn_cap, final_cap = meta.get(f"{arch}.attn_logit_softcapping"), meta.get(f"{arch}.final_logit_softcapping")
    local = None
    if arch == "gemma3":
        local = RopeConfig(theta=float(meta.get(f"{arch}.rope.freq_base_swa", _GEMMA3_LOCAL_THETA)),
                           max_position_embeddings=config.context_length)
    scalar = config.hidden_size // config.num_heads if config.num_layers == _GEMMA_27B_BLOCKS[arch] else None
    return replace(config, norm_plus_one=True, sandwich_norms=True, embedding_scale=config.hidden_size**0.5,
                   hidden_act="gelu_pytorch_tanh", local_rope=local, query_pre_attn_scalar=scalar,
                   attn_logit_softcapping=float(attn_cap) if attn_cap else None,
                   final_logit_softcapping=float(final_cap) if final_cap else None)


def _layer_windows(meta: dict, arch: str, layers: int) -> tuple[int, ...]:
    """``{arch}.attention.sliding_window`` on the sliding layers, empty when absent or 0.
    Which layers slide: ``{arch}.attention.sliding_window_pattern`` when present (llama.cpp's
    per-layer booleans, or a period ``n``: layer ``i`` slides unless ``i % n == n - 1``), else
    Gemma 2's every other layer and Gemma 3's five of six (llama.cpp's fixed periods), else every
    layer (Mistral's GGUFs: arch ``llama``)."""
    window = int(meta.get(f"{arch}.attention.sliding_window", 0) or 0)
    if window <= 0:
        return ()
    pattern = meta.get(f"{arch}.attention.sliding_window_pattern", _GEMMA_SWA_PERIOD.get(arch))
    if isinstance(pattern, (list, tuple)):
        if len(pattern) != layers:
            raise ValueError(f"{arch}.attention.sliding_window_pattern has {len(pattern)} entries for {layers} layers")
        slides = [bool(p) for p in pattern]
    elif pattern:
        slides = [i % int(pattern) < int(pattern) - 1 for i in range(layers)]
    else:
        slides = [True] * layers
    windows = tuple(window if slide else 0 for slide in slides)
    return windows if any(windows) else ()


def _dequantize(tensor) -> np.ndarray:
    from gguf.quants import dequantize

    # GGUF shapes are innermost-first; dequantize returns the row-major [out, in] array.
    array = np.ascontiguousarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
    return array if array.flags.writeable else array.copy()  # F32 tensors come back as read-only mmap views


def _kquant_weight(tensor) -> KQuantWeight:
    """A K-quant tensor's blocks as a :class:`KQuantWeight` over the reader's read-only memory
    map (``tensor.data``: uint8 ``[rows, row bytes]``); the kernels only read it."""
    with warnings.catch_warnings():  # torch warns that the array is not writable; nothing writes to it
        warnings.simplefilter("ignore", UserWarning)
        blocks = torch.from_numpy(tensor.data)
    in_features = int(tensor.shape[0])  # GGUF shapes are innermost-first
    return KQuantWeight.from_blocks(blocks.reshape(int(tensor.shape[1]), -1), tensor.tensor_type.name.lower(),
                                    in_features)


def _unpermute_kquant(weight: KQuantWeight, name: str, config: ModelConfig, arch: str) -> KQuantWeight:
    """:func:`_unpermute` for a K-quant weight: its rows (whole blocks each) copied in HF order."""
    if arch not in PERMUTED_ARCHS or not (".q_proj." in name or ".k_proj." in name):
        return weight
    order = _unpermute(torch.arange(weight.out_features)[:, None], name, config, arch)[:, 0]
    return weight.permute_rows(order)


def _hf_name(name: str, arch: str = "llama") -> str:
    if name in _TOP_NAMES:
        return _TOP_NAMES[name]
    parts = name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and arch == "phi3" and parts[2] in _PHI3_NAMES:
        return f"model.layers.{parts[1]}.{_PHI3_NAMES[parts[2]]}"
    if len(parts) == 3 and parts[0] == "blk" and arch in GEMMA_ARCHS and parts[2] in _GEMMA_NAMES:
        return f"model.layers.{parts[1]}.{_GEMMA_NAMES[parts[2]]}"
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
