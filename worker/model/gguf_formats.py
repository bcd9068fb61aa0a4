"""Which weights keep their blocks: the converters from a float weight to a scheme's block
weights (:func:`projection_converter` for ``q8_0``/``q4_1``, :func:`gguf_converter` per GGUF
tensor for ``gguf``), and the block format each fused projection of a GGUF file keeps
(:func:`projection_format`, :func:`layer_formats`)."""

from __future__ import annotations

import torch

from worker.model.block_weights import Q4Weight, Q8Weight
from worker.model.dense_weights import projection_sizes, with_dense
from worker.model.kquant import KQUANT_TYPES

GGUF_BLOCK_FORMATS = ("q4_1", "q8_0")  # GGUF tensor types ``gguf`` repacks into its tiles
KQUANT_FORMATS = tuple(KQUANT_TYPES)  # kept in the file's own blocks (worker.model.kquant)


def projection_converter(quantization: str):
    """``(projections, lm_head)``: the functions turning a float ``[out, in]`` weight into
    the ``quantization``'s weights: Q8_0 for both with ``q8_0``; with ``q4_1`` Q4_1
    projections and a Q8_0 lm_head (as llama.cpp's Q4_1 files keep their output matrix
    in 8 bits, the most sensitive one: SmolLM2-135M's Q4_1 GGUF holds it in Q8_0).

    Raises:
        ValueError: ``none``, ``gguf`` (per tensor: :func:`gguf_converter`) or an unknown scheme."""
    if quantization == "q8_0":
        return Q8Weight.quantize, Q8Weight.quantize
    if quantization == "q4_1":
        return Q4Weight.quantize, Q8Weight.quantize
    raise ValueError(f"no quantized weights for {quantization!r}")


def gguf_converter(block_format: str | None, fallback, bf16_activations: bool = False, dense_min_rows: int = 0):
    """The function turning a float ``[out, in]`` weight that a GGUF file held in
    ``block_format`` (:func:`projection_format`) into its ``gguf`` weight: a weight-only
    :class:`Q4Weight` for ``q4_1``, :class:`Q8Weight` for ``q8_0`` (either's products with
    bfloat16-rounded activations when ``bf16_activations``, and then with a dense bfloat16 copy
    for steps of ``dense_min_rows`` rows or more when that is positive: :func:`worker.model.dense_weights.with_dense`;
    without bfloat16 activations the count is the K-quant weights' alone),
    else ``fallback`` (the float path's packing)."""
    if block_format not in GGUF_BLOCK_FORMATS:
        return fallback
    from inflight_kernels.reference import q4_1_round, q8_0_round

    cls, dequantized = (Q4Weight, q4_1_round) if block_format == "q4_1" else (Q8Weight, q8_0_round)

    def convert(w: torch.Tensor):
        blocks = cls.quantize(w, float_activations=True, bf16_activations=bf16_activations)
        # the blocks' own values (a GGUF file's dequantized weights come back unchanged)
        return with_dense(blocks, dequantized(w), dense_min_rows) if dense_min_rows > 0 and bf16_activations else blocks

    return convert


def projection_format(formats: dict[str, str], names: list[str]) -> str | None:
    """The block format a fused projection keeps under ``gguf``: the GGUF tensor type
    (lower case, :func:`worker.model.gguf_loader.gguf_tensor_formats`) that all of its
    HF-named parts ``names`` present in ``formats`` share, when it is one of
    :data:`GGUF_BLOCK_FORMATS`; None (dequantized to float) when they differ, when
    another type or when none is listed. Mixed parts, e.g. a Q4_K_M file's Q4_K q and
    Q6_K v, are not re-quantized: that would change the weights."""
    kinds = {formats[name] for name in names if name in formats}
    if len(kinds) != 1:
        return None
    kind = kinds.pop()
    return kind if kind in GGUF_BLOCK_FORMATS else None


def layer_formats(formats: dict[str, str], layer: int, tied_lm_head: bool) -> dict[str, str | None]:
    """:func:`projection_format` of each fused projection of decoder layer ``layer``
    (``qkv``, ``o``, ``gate_up``, ``down``, from their HF-named parts, separate or
    already fused as in Phi-3) and of the ``lm_head`` (the embedding's when tied)."""
    p = f"model.layers.{layer}."
    attn, mlp = p + "self_attn.", p + "mlp."
    parts = {"qkv": [attn + "q_proj.weight", attn + "k_proj.weight", attn + "v_proj.weight", attn + "qkv_proj.weight"],
             "o": [attn + "o_proj.weight"],
             "gate_up": [mlp + "gate_proj.weight", mlp + "up_proj.weight", mlp + "gate_up_proj.weight"],
             "down": [mlp + "down_proj.weight"],
             "lm_head": ["model.embed_tokens.weight" if tied_lm_head else "lm_head.weight"]}
    return {name: projection_format(formats, names) for name, names in parts.items()}


def copied_bytes(config, formats: dict[str, str], tied_lm_head: bool = True) -> int:
    """Bytes of the dense bfloat16 copies ``--dense-weights-min-rows`` would make for a GGUF file
    of ``formats`` (each HF-named weight's type, :func:`worker.model.gguf_loader.gguf_tensor_formats`):
    2 bytes a weight of each projection kept in Q4_1/Q8_0 blocks (:func:`layer_formats`) and of
    the lm_head if it is; K-quant weights take no copy (their bfloat16 tiles are made per product),
    so a Q4_K_M file's copies weigh 0. ``config``: a :class:`worker.model.model_config.ModelConfig`."""
    sizes = projection_sizes(config)
    total = 0
    for layer in range(config.num_layers):
        kinds = layer_formats(formats, layer, tied_lm_head)
        total += sum(size for name, size in sizes.items() if kinds[name] is not None)
    if layer_formats(formats, 0, tied_lm_head)["lm_head"] is not None:
        total += config.vocab_size * config.hidden_size
    return 2 * total
