"""A Llama-family decoder written for serving (Touvron et al. 2023; HF
``LlamaForCausalLM`` numerics): every scheduled token of a step is one row of
``[num_tokens, hidden]``; q/k/v and gate/up projections are fused matmuls.

The same blocks with their variations serve Qwen2/2.5 (q/k/v biases), Qwen3
(q/k RMSNorm per head), Mistral and Phi-3 (sliding window; Phi-3's fused
``qkv_proj``/``gate_up_proj`` load as they are), Gemma 2 and Gemma 3 text
(Gemma Team 2024/2025: (1 + w) RMSNorm, norms after attention and around the
MLP, ``sqrt(hidden)`` embedding scale, GeGLU, attention and final logit
soft-caps, alternating local/global layers with their own RoPE), with
RoPE scalings from :mod:`worker.model.rope`. Models with Llama's block layout
(:attr:`ModelConfig.llama_layout`) take the fused CPU path; the others the torch path."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

import inflight_kernels
from worker.model.attention import AttentionMetadata, paged_attention_layer
from worker.model.kquant import KQuantWeight
from worker.model.lora_batch import LoraBatch
from worker.model.model_config import ModelConfig
from worker.model.layers import apply_rope, gelu_tanh_mul, gemma_rms_norm, rms_norm, silu_mul
from worker.model.linear import BF16Weight, can_pack, linear, pack
from worker.model.block_weights import Q4Weight, Q8Weight
from worker.model.gguf_formats import gguf_converter, layer_formats, projection_converter
from worker.model.rope import RopeConfig, rope_cos_sin

RopeTables = dict[RopeConfig, tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class LayerWeights:
    """One decoder block: qkv ``[q+2kv, hidden]`` (+ bias), o ``[hidden, q]``,
    gate_up ``[2*inter, hidden]``, down ``[hidden, inter]``, the norms before
    attention and before the MLP ``[hidden]``; optional q/k norms ``[head_dim]``
    (Qwen3, Gemma 3) and the norms of the attention and MLP outputs ``[hidden]``
    (Gemma 2/3). Gemma's norms are float32 ``1 + w``."""

    input_norm: torch.Tensor
    qkv: torch.Tensor
    qkv_bias: torch.Tensor | None
    o: torch.Tensor
    post_norm: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None
    attn_out_norm: torch.Tensor | None = None
    mlp_out_norm: torch.Tensor | None = None


class LlamaDecoder:
    """Forward pass over a flattened batch with a paged KV cache.

    Build with :meth:`from_weights` from HF-named float weights.

    Attributes:
        tied_lm_head: the output projection is the embedding matrix (counted once).
        packed: projection weights are prepacked for oneDNN (:mod:`worker.model.linear`)
            or quantized.
        quantization: "none", "q8_0", "q4_1" or "gguf" (:mod:`worker.model.quantization`).
    """

    def __init__(self, config: ModelConfig, embed: torch.Tensor, layers: list[LayerWeights],
                 norm: torch.Tensor, lm_head: torch.Tensor) -> None:
        self.config = config
        self.embed = embed
        self.layers = layers
        self.norm = norm
        self.lm_head = lm_head
        self.scale = config.attention_scale
        self.tied_lm_head = lm_head is embed
        self.packed = False
        self.quantization = "none"
        self.dense_min_rows = 0  # steps of this many rows or more use dense bfloat16 products (0: none)
        self.use_decode_stack = True  # a step runs its layers in one C++ call where it can (_decode_stack)
        self._stack = None  # (cache key, inflight_kernels.decode_stack, distinct RoPEs in layer order)

    def pack_weights(self, quantization: str = "none", formats: dict[str, str] | None = None,
                     bf16_activations: bool = False, dense_min_rows: int = 0) -> bool:
        """Prepack every projection and the lm_head for oneDNN when
        :func:`~worker.model.linear.can_pack` allows (CPU float32 or bfloat16),
        or with ``quantization`` "q8_0" or "q4_1" quantize them
        (:func:`~worker.model.gguf_formats.projection_converter`); with "gguf" keep
        those that the GGUF file held in Q4_1 or Q8_0 blocks (``formats``: each HF-named
        weight's GGUF type, :func:`~worker.model.gguf_loader.gguf_tensor_formats`) as
        weight-only blocks and prepack the others, giving the blocks a dense bfloat16 copy for
        steps of ``dense_min_rows`` rows or more when that is positive
        (:func:`~worker.model.dense_weights.with_dense`); K-quant weights keep the file's blocks
        and take bfloat16 tiles made per product from that many rows instead (no copy). The embedding stays plain for the
        token lookup. Returns whether it packed.

        Raises:
            ValueError: a quantization with weights other than float32 on the CPU;
                ValueError / RuntimeError: see :meth:`Q8Weight.quantize`, :meth:`Q4Weight.quantize`."""
        if self.packed:
            return True
        if quantization != "none":
            if self.dtype != torch.float32 or self.device.type != "cpu":
                raise ValueError(f"{quantization} runs float32 on the CPU, not {self.dtype} on {self.device}")
        elif not can_pack(self.dtype, self.device):
            return False
        self.layers = [self._converted(i, layer, quantization, formats or {}, bf16_activations, dense_min_rows)
                       for i, layer in enumerate(self.layers)]
        if quantization == "gguf":
            self.lm_head = _kept(gguf_converter(layer_formats(formats or {}, 0, self.tied_lm_head)["lm_head"],
                                                pack, bf16_activations, dense_min_rows), dense_min_rows)(self.lm_head)
            if self.tied_lm_head and isinstance(self.lm_head, KQuantWeight):
                self.embed = self.lm_head  # the same blocks: the lookup reads them, the head multiplies them
            weights = [self.lm_head] + [p for layer in self.layers for p in (layer.qkv, layer.o, layer.gate_up, layer.down)]
            dense = any(getattr(p, "dense", None) is not None or getattr(p, "dense_min_rows", 0) for p in weights)
            self.dense_min_rows = dense_min_rows if dense else 0  # no Q4_1/Q8_0 copies and no K-quant tiles: none
        else:
            self.lm_head = (pack if quantization == "none" else projection_converter(quantization)[1])(self.lm_head)
        self.quantization = quantization
        self.packed = True
        return True

    def _converted(self, i: int, layer: LayerWeights, quantization: str, formats: dict[str, str],
                   bf16_activations: bool, dense_min_rows: int) -> LayerWeights:
        """Layer ``i``'s projections packed or quantized for :meth:`pack_weights`."""
        if quantization == "gguf":
            kinds = layer_formats(formats, i, self.tied_lm_head)
            convert = {name: _kept(gguf_converter(kinds[name], pack, bf16_activations, dense_min_rows), dense_min_rows)
                       for name in ("qkv", "o", "gate_up", "down")}
        else:
            one = pack if quantization == "none" else projection_converter(quantization)[0]
            convert = dict.fromkeys(("qkv", "o", "gate_up", "down"), one)
        return replace(layer, **{name: fn(getattr(layer, name)) for name, fn in convert.items()})

    @property
    def dtype(self) -> torch.dtype:
        """Weight dtype (float32 for an embedding held in K-quant blocks)."""
        return self.embed.dtype

    @property
    def device(self) -> torch.device:
        """Weight device."""
        return self.embed.device

    def _embed_rows(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The embeddings of ``input_ids`` ``[num_tokens]``: ``[num_tokens, hidden]`` in the
        compute dtype (dequantized rows when the file keeps the embedding in K-quant blocks)."""
        if isinstance(self.embed, KQuantWeight):
            return self.embed.lookup(input_ids)
        return self.embed[input_ids]

    @classmethod
    def from_weights(cls, config: ModelConfig, weights: dict[str, torch.Tensor],
                     dtype: torch.dtype, device: str | torch.device, pack: bool = True,
                     quantization: str = "none", formats: dict[str, str] | None = None,
                     bf16_activations: bool = False, dense_min_rows: int = 0) -> "LlamaDecoder":
        """Fuse and cast HF-named weights (``model.layers.{i}.self_attn.q_proj.weight`` ...).

        ``lm_head.weight`` is optional: when absent (or ``tie_word_embeddings``)
        the embedding matrix is used. ``pack``: call :meth:`pack_weights`
        (with ``quantization`` and, for "gguf", the file's tensor ``formats``,
        ``bf16_activations`` and ``dense_min_rows``).

        Raises:
            ValueError: a required weight is missing or has the wrong shape.
        """
        take = _Taker(weights, dtype, device, config.norm_plus_one)
        embed = take("model.embed_tokens.weight", (config.vocab_size, config.hidden_size))
        has_head = "lm_head.weight" in weights and not config.tie_word_embeddings
        lm_head = take("lm_head.weight", embed.shape) if has_head else embed
        layers = [_layer(take, config, f"model.layers.{i}.") for i in range(config.num_layers)]
        decoder = cls(config, embed, layers, take.norm("model.norm.weight", (config.hidden_size,)), lm_head)
        if pack:
            decoder.pack_weights(quantization, formats, bf16_activations, dense_min_rows)
        return decoder

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], logits_indices: torch.Tensor,
                hidden_only: bool = False, lora: LoraBatch | None = None) -> torch.Tensor:
        """Run one step.

        Args:
            input_ids, positions: ``[num_tokens]`` int64.
            meta: slot mapping, prefill spans and decode block tables.
            kv_caches: per layer ``(key_cache, value_cache)``.
            logits_indices: ``[rows]`` int64 batch rows that need logits.
            hidden_only: return those rows' final-norm hidden states instead of logits (the
                pooling runner's embeddings, worker/engine/pooling_engine.py; no lm_head).
            lora: the step's LoRA adapters, each row's delta added to its projections
                (:class:`~worker.model.lora_batch.LoraBatch`); None: base rows only. A step with
                LoRA rows takes the layer-by-layer path, never the one-call decode stack.

        Returns:
            logits ``[rows, vocab_size]`` float32 (lm_head runs on those rows only), or with
            ``hidden_only`` the hidden states ``[rows, hidden_size]`` float32 after the final norm.
        """
        if (ops := self._fused_ops()) is not None:
            return self._forward_fused(ops, input_ids, positions, meta, kv_caches, logits_indices, hidden_only,
                                       lora)
        cfg = self.config
        hidden = self._embed_rows(input_ids)
        if cfg.embedding_scale != 1.0:  # rounded to the dtype first, as HF's Gemma does
            hidden = hidden * torch.tensor(cfg.embedding_scale, dtype=hidden.dtype)
        tables = self._rope_tables(positions, meta, hidden.dtype)
        for i, (layer, (key_cache, value_cache)) in enumerate(zip(self.layers, kv_caches)):
            attn = self._attention(i, layer, self._norm(hidden, layer.input_norm), tables, meta, key_cache,
                                   value_cache, lora)
            hidden = hidden + (attn if layer.attn_out_norm is None else self._norm(attn, layer.attn_out_norm))
            mlp_in = self._norm(hidden, layer.post_norm)
            gate_up = _lora(lora, i, "gate_up", mlp_in, linear(mlp_in, layer.gate_up))
            act = silu_mul(gate_up) if cfg.hidden_act == "silu" else gelu_tanh_mul(gate_up)
            mlp = _lora(lora, i, "down", act, linear(act, layer.down))
            hidden = hidden + (mlp if layer.mlp_out_norm is None else self._norm(mlp, layer.mlp_out_norm))
        last = self._norm(hidden[logits_indices], self.norm)
        if hidden_only:
            return last.float()
        logits = linear(last, self.lm_head)
        if cfg.final_logit_softcapping:  # in the compute dtype, as HF's Gemma 2
            cap = cfg.final_logit_softcapping
            logits = torch.tanh(logits / cap) * cap
        return logits.float()

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """The model's RMSNorm of ``x`` ``[..., dim]`` (Llama's, or Gemma's (1 + w))."""
        if self.config.norm_plus_one:
            return gemma_rms_norm(x, weight, self.config.rms_norm_eps)
        return rms_norm(x, weight, self.config.rms_norm_eps)

    def _rope_tables(self, positions: torch.Tensor, meta: AttentionMetadata, dtype: torch.dtype) -> RopeTables:
        """cos/sin ``[num_tokens, head_dim]`` of each distinct RoPE of the layers."""
        cfg = self.config
        ropes = {cfg.layer_rope(i) for i in range(cfg.num_layers)}
        return {rope: rope_cos_sin(rope, cfg.head_dim, positions, meta.token_seq_lens, dtype) for rope in ropes}

    @property
    def fused(self) -> bool:
        """True when :meth:`forward` takes the fused CPU path (:meth:`_fused_ops`)."""
        return self._fused_ops() is not None

    def _fused_ops(self) -> inflight_kernels.FusedLayerOps | None:
        """The layer ops of the fused path where :meth:`forward` takes it: the blocks are
        Llama's (:attr:`ModelConfig.llama_layout`) and the kernels hand out their fused layer
        ops for the weights' device and dtype (:func:`inflight_kernels.fused_layer_ops`); else None."""
        if not self.config.llama_layout:
            return None
        return inflight_kernels.fused_layer_ops(self.norm if isinstance(self.embed, KQuantWeight) else self.embed)

    def _forward_fused(self, ops: inflight_kernels.FusedLayerOps, input_ids, positions, meta, kv_caches,
                       logits_indices, hidden_only: bool = False, lora: LoraBatch | None = None) -> torch.Tensor:
        """:meth:`forward` with the residual add folded into the next RMSNorm,
        RoPE applied in place on the fused qkv rows and SiLU*up in one pass
        (same rounding points as the torch path; ``inflight_kernels/cpu/layer_ops.cpp``)."""
        eps = self.config.rms_norm_eps
        hidden = self._embed_rows(input_ids)
        tables = self._rope_tables(positions, meta, hidden.dtype)
        stack = self._decode_stack(meta, kv_caches) if lora is None else None
        if stack is not None:
            kernel, ropes = stack
            block_tables, context_lens = _row_tables(meta, positions)
            kernel.forward(hidden, [tables[r][0] for r in ropes], [tables[r][1] for r in ropes],
                           meta.slot_mapping.contiguous(), block_tables, context_lens)
            last = ops.rms_norm(hidden[logits_indices], self.norm, eps)
            return last.float() if hidden_only else linear(last, self.lm_head).float()
        normed = ops.rms_norm(hidden, self.layers[0].input_norm, eps)
        for i, (layer, (key_cache, value_cache)) in enumerate(zip(self.layers, kv_caches)):
            attn = self._attention_fused(ops, i, layer, normed, tables, meta, key_cache, value_cache, lora)
            mlp_in = ops.add_rms_norm(hidden, attn, layer.post_norm, eps)
            act = ops.silu_mul(_lora(lora, i, "gate_up", mlp_in, linear(mlp_in, layer.gate_up)))
            mlp_out = _lora(lora, i, "down", act, linear(act, layer.down))
            if i + 1 < len(self.layers):
                normed = ops.add_rms_norm(hidden, mlp_out, self.layers[i + 1].input_norm, eps)
            else:
                hidden += mlp_out
        last = ops.rms_norm(hidden[logits_indices], self.norm, eps)
        return last.float() if hidden_only else linear(last, self.lm_head).float()

    def _decode_stack(self, meta: AttentionMetadata, kv_caches):
        """``(kernel, ropes)`` running this step's layers in one C++ call
        (:func:`inflight_kernels.decode_stack`, built once per cache), or None where the
        Python fused path runs: weights other than q8_0, q4_1, K-quant blocks or
        :class:`~worker.model.linear.BF16Weight`, :attr:`use_decode_stack` off,
        or a cache the compiled decode attention does not take. Prefill and
        verification chunks run in it too: where that kernel runs, the Python
        path attends every prefill row as a decode of context ``position + 1``
        (:func:`worker.model.attention._prefill_attention`, :func:`inflight_kernels.prefill_as_decode`), so one call over all
        rows gives the same bits."""
        if not self.use_decode_stack or not kv_caches or not self._stackable_weights():
            return None
        # rebuilt when the cache, the weights or the config are replaced
        key = (len(kv_caches), kv_caches[0][0].data_ptr(), kv_caches[-1][1].data_ptr(), id(self.layers),
               id(self.config))
        if self._stack is None or self._stack[0] != key:
            self._stack = (key, self._build_decode_stack(kv_caches))
        return self._stack[1]

    def _stackable_weights(self) -> bool:
        projections = [p for layer in self.layers for p in (layer.qkv, layer.o, layer.gate_up, layer.down)]
        types = {type(p) for p in projections}
        blocks = [p for p in projections if isinstance(p, (Q4Weight, Q8Weight))]
        # K-quant products always take float32 activations, as weight-only Q4_1/Q8_0 ones do
        weight_only = {p.float_activations for p in blocks} | ({True} if KQuantWeight in types else set())
        bf16 = {p.bf16_activations for p in blocks}
        return (len(weight_only) <= 1 and len(bf16) <= 1
                and (types <= {Q8Weight, Q4Weight, KQuantWeight} or types == {BF16Weight}))

    def _build_decode_stack(self, kv_caches):
        cfg = self.config
        ropes = list(dict.fromkeys(cfg.layer_rope(i) for i in range(cfg.num_layers)))
        empty = torch.empty(0)
        weights, caches, kquant_parts, kquant_layout = [], [], [], []
        for layer, (key_cache, value_cache) in zip(self.layers, kv_caches):
            weights += [layer.input_norm, layer.post_norm, empty if layer.qkv_bias is None else layer.qkv_bias.float()]
            for proj in (layer.qkv, layer.o, layer.gate_up, layer.down):
                if isinstance(proj, KQuantWeight):
                    weights += [empty, empty, empty]
                    kquant_parts += [part.blocks for part in proj.parts]
                    kquant_layout += [len(proj.parts)] + [part.ggml_type for part in proj.parts]
                    continue
                kquant_layout.append(0)
                dense = getattr(proj, "dense", None)
                weights += [proj.packed, proj.scales if isinstance(proj, Q8Weight) else empty,
                            empty if dense is None else dense]
            caches += [key_cache, value_cache]
        if not kquant_parts:
            kquant_layout = []
        first = self.layers[0]
        kernel = inflight_kernels.decode_stack(
            weights, caches, [cfg.window(i) for i in range(cfg.num_layers)],
            [ropes.index(cfg.layer_rope(i)) for i in range(cfg.num_layers)],
            [p.out_features for p in (first.qkv, first.o, first.gate_up, first.down)], cfg.num_heads,
            cfg.num_kv_heads, cfg.head_dim, cfg.rms_norm_eps, self.scale, cfg.attn_logit_softcapping or 0.0,
            float_activations=any(getattr(p, "float_activations", False) for p in self._blocks()),
            bf16_activations=any(getattr(p, "bf16_activations", False) for p in self._blocks()),
            dense_min_rows=self.dense_min_rows, kquant_parts=kquant_parts, kquant_layout=kquant_layout)
        return None if kernel is None else (kernel, ropes)

    def _blocks(self) -> list:
        """The projections packed as Q4_1 or Q8_0 blocks."""
        return [p for layer in self.layers for p in (layer.qkv, layer.o, layer.gate_up, layer.down)
                if isinstance(p, (Q4Weight, Q8Weight))]

    def _attention_fused(self, ops: inflight_kernels.FusedLayerOps, i: int, layer: LayerWeights, x,
                         tables: RopeTables, meta, key_cache, value_cache, lora: LoraBatch | None = None) -> torch.Tensor:
        cfg = self.config
        cos, sin = tables[cfg.layer_rope(i)]
        qkv = _lora(lora, i, "qkv", x, linear(x, layer.qkv, layer.qkv_bias))  # [N, q + 2 kv]
        ops.rope_qk(qkv, cos, sin, cfg.num_heads + cfg.num_kv_heads, cfg.head_dim)
        n, q_end, k_end = qkv.shape[0], cfg.q_size, cfg.q_size + cfg.kv_size
        q = qkv[:, :q_end].view(n, cfg.num_heads, cfg.head_dim)
        k = qkv[:, q_end:k_end].view(n, cfg.num_kv_heads, cfg.head_dim)
        v = qkv[:, k_end:].view(n, cfg.num_kv_heads, cfg.head_dim)
        return self._attend_and_project(i, layer, q, k, v, meta, key_cache, value_cache, lora)

    def _attention(self, i: int, layer: LayerWeights, x, tables: RopeTables, meta, key_cache,
                   value_cache, lora: LoraBatch | None = None) -> torch.Tensor:
        cfg = self.config
        cos, sin = tables[cfg.layer_rope(i)]
        qkv = _lora(lora, i, "qkv", x, linear(x, layer.qkv, layer.qkv_bias))
        q, k, v = qkv.split([cfg.q_size, cfg.kv_size, cfg.kv_size], dim=-1)
        q, k = q.view(-1, cfg.num_heads, cfg.head_dim), k.view(-1, cfg.num_kv_heads, cfg.head_dim)
        if cfg.qk_norm:
            q, k = self._norm(q, layer.q_norm), self._norm(k, layer.k_norm)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        v = v.contiguous().view(-1, cfg.num_kv_heads, cfg.head_dim)  # CUDA kernels need contiguous K/V
        return self._attend_and_project(i, layer, q, k, v, meta, key_cache, value_cache, lora)

    def _attend_and_project(self, i: int, layer: LayerWeights, q, k, v, meta, key_cache,
                            value_cache, lora: LoraBatch | None = None) -> torch.Tensor:
        """Cache k/v, attend (layer ``i``'s window and soft-cap), then the output
        projection: ``[num_tokens, hidden]``."""
        cfg = self.config
        out = paged_attention_layer(q, k, v, key_cache, value_cache, meta, self.scale,
                                    sliding_window=cfg.window(i) or None, logits_soft_cap=cfg.attn_logit_softcapping)
        out = out.reshape(-1, cfg.q_size)
        return _lora(lora, i, "o", out, linear(out, layer.o))


def _lora(lora: LoraBatch | None, layer: int, projection: str, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``out``, layer ``layer``'s ``projection`` of ``x``, with each row's LoRA delta added
    (:meth:`~worker.model.lora_batch.LoraBatch.apply`); ``out`` as it is without LoRA."""
    return out if lora is None else lora.apply(layer, projection, x, out)


def _row_tables(meta: AttentionMetadata, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's block table ``[num_tokens, max_blocks]`` int32 and context length
    ``[num_tokens]`` int32 (``position + 1``) for attending every row as a decode:
    a prefill row gets its chunk's table, a decode row its own."""
    if not meta.prefills:
        return meta.decode_block_tables.contiguous(), meta.decode_context_lens.contiguous()
    width = max([span.block_table.numel() for span in meta.prefills] + [meta.decode_block_tables.shape[1]])
    parts = []
    for span in meta.prefills:
        table = torch.nn.functional.pad(span.block_table.to(torch.int32), (0, width - span.block_table.numel()))
        parts.append(table[None].expand(span.token_end - span.token_start, -1))
    decodes = meta.decode_block_tables
    parts.append(torch.nn.functional.pad(decodes, (0, width - decodes.shape[1])) if decodes.numel() else
                 decodes.new_zeros(0, width))
    return torch.cat(parts).contiguous(), (positions + 1).to(torch.int32)


class _Taker:
    """Fetch a weight by name, check its shape, cast and move it; :meth:`norm`
    makes Gemma's norm weights float32 ``1 + w`` (``norm_plus_one``)."""

    def __init__(self, weights, dtype, device, norm_plus_one: bool = False) -> None:
        self.weights, self.dtype, self.device, self.norm_plus_one = weights, dtype, device, norm_plus_one

    def has(self, name: str) -> bool:
        """Whether the checkpoint holds ``name``."""
        return name in self.weights

    def norm(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        """A norm weight: as stored, or ``1 + w`` in float32 (w rounded to the dtype first)."""
        weight = self(name, shape)
        return 1.0 + weight.float() if self.norm_plus_one else weight

    def __call__(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        if name not in self.weights:
            raise ValueError(f"missing weight {name!r}")
        tensor = self.weights[name]
        if tuple(tensor.shape) != tuple(shape):
            raise ValueError(f"weight {name!r} has shape {tuple(tensor.shape)}, expected {tuple(shape)}")
        if isinstance(tensor, KQuantWeight):  # kept in the file's blocks: float32 products on the CPU
            if self.dtype != torch.float32 or torch.device(self.device).type != "cpu":
                return tensor.dequantize().to(device=self.device, dtype=self.dtype)
            return tensor
        return tensor.to(device=self.device, dtype=self.dtype).contiguous()


def _cat(parts: list) -> torch.Tensor | KQuantWeight:
    """A fused projection from its parts: a :class:`KQuantWeight` sharing their blocks when all
    are kept in K-quant blocks, else a float tensor (blocks dequantized where the parts mix)."""
    if all(isinstance(p, KQuantWeight) for p in parts):
        return KQuantWeight.cat(parts)
    floats = [p.dequantize() if isinstance(p, KQuantWeight) else p for p in parts]
    dtype = next(p.dtype for p in parts if not isinstance(p, KQuantWeight))
    return torch.cat([p.to(dtype) for p in floats])


def _kept(convert, dense_min_rows: int = 0):
    """``convert`` for a projection, leaving a :class:`KQuantWeight`'s blocks as they are (they are
    already what the ``gguf`` products read) and giving it ``dense_min_rows`` for its products of
    many rows (tiles dequantized per product; 0 where the kernels lack them: :func:`inflight_kernels.cpu_kquant_tiles`)."""
    rows = dense_min_rows if dense_min_rows > 0 and inflight_kernels.cpu_kquant_tiles() else 0

    def kept(weight):
        if not isinstance(weight, KQuantWeight):
            return convert(weight)
        return weight if weight.dense_min_rows == rows else replace(weight, dense_min_rows=rows)

    return kept


def _layer(take: _Taker, cfg: ModelConfig, prefix: str) -> LayerWeights:
    attn, mlp, h = prefix + "self_attn.", prefix + "mlp.", cfg.hidden_size
    if take.has(attn + "qkv_proj.weight"):  # Phi-3: already fused, q then k then v
        qkv = take(attn + "qkv_proj.weight", (cfg.q_size + 2 * cfg.kv_size, h))
    else:
        qkv = _cat([take(attn + "q_proj.weight", (cfg.q_size, h)),
                    take(attn + "k_proj.weight", (cfg.kv_size, h)), take(attn + "v_proj.weight", (cfg.kv_size, h))])
    bias = None
    if cfg.attention_bias:
        bias = torch.cat([take(attn + "q_proj.bias", (cfg.q_size,)), take(attn + "k_proj.bias", (cfg.kv_size,)),
                          take(attn + "v_proj.bias", (cfg.kv_size,))])
    if take.has(mlp + "gate_up_proj.weight"):  # Phi-3: gate rows then up rows
        gate_up = take(mlp + "gate_up_proj.weight", (2 * cfg.intermediate_size, h))
    else:
        gate_up = _cat([take(mlp + "gate_proj.weight", (cfg.intermediate_size, h)),
                        take(mlp + "up_proj.weight", (cfg.intermediate_size, h))])
    head = (cfg.head_dim,)
    sandwich = cfg.sandwich_norms  # Gemma: post_attention_layernorm normalizes the attention output
    return LayerWeights(
        input_norm=take.norm(prefix + "input_layernorm.weight", (h,)),
        qkv=qkv, qkv_bias=bias,
        o=take(attn + "o_proj.weight", (h, cfg.q_size)),
        post_norm=take.norm(prefix + ("pre_feedforward_layernorm.weight" if sandwich
                                      else "post_attention_layernorm.weight"), (h,)),
        gate_up=gate_up,
        down=take(mlp + "down_proj.weight", (h, cfg.intermediate_size)),
        q_norm=take.norm(attn + "q_norm.weight", head) if cfg.qk_norm else None,
        k_norm=take.norm(attn + "k_norm.weight", head) if cfg.qk_norm else None,
        attn_out_norm=take.norm(prefix + "post_attention_layernorm.weight", (h,)) if sandwich else None,
        mlp_out_norm=take.norm(prefix + "post_feedforward_layernorm.weight", (h,)) if sandwich else None,
    )
