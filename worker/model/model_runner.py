"""Runs one engine step (a :class:`~worker.runner_io.ModelInput`) through the model
over the paged KV cache and returns logits for the rows that need them."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from itertools import chain
from pathlib import Path

import torch

import inflight_kernels

from worker.runner_io import ModelInput, ModelOutput, ScheduledChunk
from worker.model.kv_cache import KVCache, KVCacheSpec
from worker.model.attention import AttentionMetadata, PrefillSpan
from worker.model.model_config import ModelConfig
from worker.model.kquant import KQuantWeight
from worker.model.llama import LlamaDecoder
from worker.model.lora import LoraAdapter, load_adapter
from worker.model.lora_base import ModelIdentity
from worker.model.lora_batch import LoraBatch, LoraStacks

DEFAULT_CPU_KV_BYTES = 512 * 1024 * 1024
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StepTensors:
    """The flattened inputs of one step.

    Attributes:
        input_ids, positions: ``[num_tokens]`` int64.
        logits_indices: ``[rows]`` int64 batch rows of chunks with needs_logits.
        meta: slot mapping, prefill spans and decode block tables.
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    logits_indices: torch.Tensor
    meta: AttentionMetadata


def build_step(chunks: list[ScheduledChunk], num_prefills: int, block_size: int,
               device: torch.device) -> StepTensors:
    """Flatten ``chunks`` (prefills first, then single-token decodes) into tensors.

    Positions, slot mapping and logits rows are computed with tensor ops
    (no per-token Python loop).

    Raises:
        ValueError: a decode with != 1 token, an empty chunk, or a block table
            too short for ``start_pos + len(token_ids)``.
    """
    _validate(chunks, num_prefills, block_size)
    lens = torch.tensor([len(c.token_ids) for c in chunks], dtype=torch.int64)
    starts = torch.tensor([c.start_pos for c in chunks], dtype=torch.int64)
    width = max(len(c.block_table) for c in chunks)
    tables = torch.tensor([c.block_table + [0] * (width - len(c.block_table)) for c in chunks], dtype=torch.int64)
    ends = torch.cumsum(lens, 0)
    seq_of_token = torch.repeat_interleave(torch.arange(len(chunks)), lens)
    positions = starts[seq_of_token] + torch.arange(int(ends[-1])) - (ends - lens)[seq_of_token]
    slot_mapping = tables[seq_of_token, positions // block_size] * block_size + positions % block_size
    needs = torch.tensor([c.needs_logits for c in chunks], dtype=torch.bool)
    prefills = tuple(
        PrefillSpan(int(ends[i] - lens[i]), int(ends[i]), chunks[i].start_pos,
                    tables[i, : len(chunks[i].block_table)].to(device))
        for i in range(num_prefills)
    )
    meta = AttentionMetadata(
        slot_mapping=slot_mapping.to(device),
        prefills=prefills,
        num_prefill_tokens=int(ends[num_prefills - 1]) if num_prefills else 0,
        decode_block_tables=tables[num_prefills:].to(torch.int32).to(device),
        decode_context_lens=(starts[num_prefills:] + 1).to(torch.int32).to(device),
        token_seq_lens=(starts + lens)[seq_of_token].to(device),
    )
    input_ids = torch.tensor(list(chain.from_iterable(c.token_ids for c in chunks)), dtype=torch.int64)
    return StepTensors(input_ids.to(device), positions.to(device), _logits_rows(chunks, ends, needs).to(device), meta)


def _logits_rows(chunks: list[ScheduledChunk], ends: torch.Tensor, needs: torch.Tensor) -> torch.Tensor:
    """[rows] int64 batch rows that return logits: each chunk's last ``num_logits`` tokens."""
    if not any(c.num_draft_tokens for c in chunks):
        return (ends - 1)[needs]
    counts = torch.tensor([c.num_logits for c in chunks], dtype=torch.int64)
    last = torch.repeat_interleave(ends, counts)
    offsets = torch.cat([torch.arange(-int(n), 0) for n in counts.tolist()])
    return last + offsets


def _validate(chunks: list[ScheduledChunk], num_prefills: int, block_size: int) -> None:
    for i, c in enumerate(chunks):
        if not c.token_ids:
            raise ValueError(f"sequence {c.seq_id}: empty chunk")
        if i >= num_prefills and len(c.token_ids) != 1:
            raise ValueError(f"sequence {c.seq_id}: decode must carry 1 token, got {len(c.token_ids)}")
        if c.num_draft_tokens and (i >= num_prefills or not 0 < c.num_draft_tokens < len(c.token_ids)):
            raise ValueError(f"sequence {c.seq_id}: {c.num_draft_tokens} draft tokens in a chunk of "
                             f"{len(c.token_ids)} (verification chunks go with the prefills)")
        if len(c.block_table) * block_size < c.start_pos + len(c.token_ids):
            raise ValueError(f"sequence {c.seq_id}: block table of {len(c.block_table)} blocks cannot hold "
                             f"{c.start_pos + len(c.token_ids)} tokens (block_size {block_size})")


class ModelRunner:
    """Owns the model and its KV cache; executes engine steps.

    Attributes:
        config: the model's :class:`ModelConfig`.
        num_blocks, block_size: KV cache geometry (blocks, tokens per block).
        vocab_size: logits width.
        context_length: maximum sequence length in tokens.
        dtype, device: compute dtype and device.
        max_lora_rank: the highest LoRA rank :meth:`add_lora` takes (``--max-lora-rank``).
        model_identity: the model's names an adapter's base model is compared with
            (:func:`worker.model.lora_base.model_identity`, set by the worker); None: not compared.
        loras: the LoRA adapters loaded, by the engine's id (:meth:`add_lora`).
    """

    def __init__(self, model: LlamaDecoder, cache: KVCache, max_lora_rank: int = 16) -> None:
        self.model = model
        self.cache = cache
        self.config = model.config
        self.num_blocks = cache.num_blocks
        self.block_size = cache.block_size
        self.vocab_size = model.config.vocab_size
        self.context_length = model.config.context_length
        self.dtype = model.dtype
        self.device = model.device
        self.max_lora_rank = max_lora_rank
        self.model_identity: ModelIdentity | None = None
        self.loras: dict[int, LoraAdapter] = {}
        self._lora_stacks = LoraStacks(model.config)

    @property
    def lora_stacks(self) -> LoraStacks:
        """The stacked weights of the loaded adapters the steps use (:class:`LoraStacks`)."""
        return self._lora_stacks

    def add_lora(self, lora_id: int, name: str, path: str) -> str:
        """Load the PEFT adapter at ``path`` as ``lora_id`` (> 0; chunks name it in
        ``ScheduledChunk.lora_id``), its tensors in the compute dtype on the runner's device.
        Returns its digest (its identity in prefix-cache block hashes).

        Raises:
            FileNotFoundError / ValueError: see :func:`worker.model.lora.load_adapter` (rank above
                :attr:`max_lora_rank`, a module the model has no LoRA for, another base model's name
                (:attr:`model_identity`) or shapes).
        """
        if lora_id <= 0:
            raise ValueError(f"lora_id must be > 0, got {lora_id}")
        adapter = load_adapter(name, path, self.config, self.max_lora_rank, self.dtype, self.device,
                               self.model_identity)
        self.loras[lora_id] = adapter
        self._lora_stacks.clear()
        return adapter.digest

    def remove_lora(self, lora_id: int) -> bool:
        """Drop adapter ``lora_id``'s tensors; False when it was not loaded."""
        self._lora_stacks.clear()
        return self.loras.pop(lora_id, None) is not None

    def _lora_batch(self, chunks: list[ScheduledChunk]) -> LoraBatch | None:
        """The step's :class:`LoraBatch` (None when every chunk runs the base model).

        Raises:
            ValueError: a chunk names an adapter that is not loaded.
        """
        ids = [c.lora_id for c in chunks]
        if not any(ids):
            return None
        distinct = list(dict.fromkeys(i for i in ids if i))
        missing = [i for i in distinct if i not in self.loras]
        if missing:
            raise ValueError(f"LoRA adapter ids {missing} are not loaded")
        slot = {lora_id: k for k, lora_id in enumerate(distinct)}
        per_chunk = torch.tensor([slot.get(i, -1) for i in ids], dtype=torch.int64)
        lens = torch.tensor([len(c.token_ids) for c in chunks], dtype=torch.int64)
        rows = torch.repeat_interleave(per_chunk, lens).to(self.device)
        return self._lora_stacks.batch([self.loras[i] for i in distinct], rows)

    @torch.inference_mode()
    def execute(self, model_input: ModelInput) -> ModelOutput:
        """Run prefills then decodes; return float32 logits ``[rows, vocab_size]``
        for chunks with needs_logits (``num_logits`` rows each), in
        ``model_input.chunks`` order.

        Raises:
            ValueError: malformed chunks (see :func:`build_step`).
        """
        self.cache.copy_blocks(model_input.blocks_to_copy)  # copy-on-write, before anything is written
        chunks = model_input.chunks
        if not chunks:
            return ModelOutput(seq_ids=[], logits=torch.empty(0, self.vocab_size, device=self.device))
        step = build_step(chunks, len(model_input.prefills), self.block_size, self.device)
        logits = self.model.forward(step.input_ids, step.positions, step.meta, self.cache.layers, step.logits_indices,
                                    lora=self._lora_batch(chunks))
        return ModelOutput(seq_ids=[c.seq_id for c in chunks for _ in range(c.num_logits)], logits=logits)

    @torch.inference_mode()
    def hidden_states(self, model_input: ModelInput, rows: list[int]) -> torch.Tensor:
        """Run ``model_input``'s prefill chunks (their KV written as :meth:`execute` does) and
        return the final-norm hidden states of the batch rows ``rows`` (token indices into the
        chunks' concatenated tokens), ``[len(rows), hidden_size]`` float32 on the runner's
        device, with no lm_head: what the pooling runner pools (worker/engine/pooling_engine.py).

        Raises:
            ValueError: decodes in ``model_input``, no prefill, or malformed chunks (:func:`build_step`).
        """
        if model_input.decodes or not model_input.prefills:
            raise ValueError("hidden_states runs prefill chunks only")
        chunks = model_input.prefills
        step = build_step(chunks, len(chunks), self.block_size, self.device)
        indices = torch.tensor(rows, dtype=torch.int64, device=self.device)
        return self.model.forward(step.input_ids, step.positions, step.meta, self.cache.layers, indices,
                                  hidden_only=True)

    @torch.inference_mode()
    def warmup(self, num_tokens: int) -> None:
        """Dummy prefill of ``num_tokens`` tokens plus one decode (readiness
        probe), written into blocks ``0..ceil((num_tokens+1)/block_size)-1``
        whose contents are saved first and restored after, so live sequences
        are unaffected.

        Raises:
            ValueError: ``num_tokens`` < 1, beyond the context length, or more
                than the cache holds.
        """
        needed = -(-(num_tokens + 1) // self.block_size)
        if num_tokens < 1 or num_tokens + 1 > self.context_length or needed > self.num_blocks:
            raise ValueError(f"warmup num_tokens={num_tokens} must be in 1..{min(self.context_length, self.num_blocks * self.block_size) - 1}")
        blocks = list(range(needed))
        ids = torch.arange(num_tokens).remainder(self.vocab_size).tolist()
        saved = self.cache.snapshot(torch.tensor(blocks, device=self.device))
        try:
            self.execute(ModelInput(prefills=[ScheduledChunk(-1, ids, 0, blocks)]))
            self.execute(ModelInput(decodes=[ScheduledChunk(-1, [0], num_tokens, blocks)]))
        finally:
            self.cache.restore(torch.tensor(blocks, device=self.device), saved)


def build_runner(config: ModelConfig, weights: dict[str, torch.Tensor], *, dtype: torch.dtype,
                 device: str | torch.device, block_size: int, num_blocks: int | None,
                 kv_cache_bytes: int | None, kv_cache_dtype: torch.dtype | None = None,
                 quantization: str = "none", formats: dict[str, str] | None = None,
                 bf16_activations: bool = False, dense_min_rows: int = 0) -> ModelRunner:
    """Model plus a KV cache sized by ``num_blocks`` or ``kv_cache_bytes``
    (default: 512 MiB on CPU, 90% of free memory on CUDA), its elements in
    ``kv_cache_dtype`` (None = the compute ``dtype``); projections quantized
    by ``quantization`` (:mod:`worker.model.quantization`; for "gguf", ``formats``
    gives each weight's GGUF type, ``bf16_activations`` whether its Q4_1 and Q8_0 products take
    bfloat16-rounded activations and ``dense_min_rows`` from how many rows a step uses their
    dense bfloat16 copies, 0 for none: :func:`worker.model.dense_weights.with_dense`)."""
    model = LlamaDecoder.from_weights(config, weights, dtype, device, quantization=quantization, formats=formats,
                                      bf16_activations=bf16_activations, dense_min_rows=dense_min_rows)
    spec = KVCacheSpec(config.num_layers, config.num_kv_heads, block_size, config.head_dim, kv_cache_dtype or dtype)
    if num_blocks is None and kv_cache_bytes is None:
        kv_cache_bytes = _default_kv_bytes(torch.device(device))
    return ModelRunner(model, KVCache.allocate(spec, num_blocks=num_blocks, budget_bytes=kv_cache_bytes, device=device))


def _default_kv_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free * 0.9)
    return DEFAULT_CPU_KV_BYTES


def load_model_runner(path: str | Path, *, dtype: str | torch.dtype = "auto", device: str | torch.device = "cpu",
                      block_size: int = 16, num_blocks: int | None = None,
                      kv_cache_bytes: int | None = None,
                      kv_cache_dtype: str | torch.dtype = "auto", quantization: str = "auto",
                      dense_min_rows: int | None = 0) -> ModelRunner:
    """Load a GGUF file or HF safetensors folder into a ready :class:`ModelRunner`.

    ``quantization="auto"`` follows :func:`worker.model.quantization.resolve_quantization`
    (a GGUF file's own Q4_1/Q8_0 blocks, weight-only, on the CPU); ``dtype="auto"``
    :func:`worker.model.dtype.resolve_dtype` (float32 with any quantization),
    ``kv_cache_dtype="auto"`` :func:`worker.model.dtype.resolve_kv_cache_dtype`;
    ``dense_min_rows`` > 0 gives the GGUF blocks dense bfloat16 copies for steps of that many
    rows or more (:func:`worker.model.dense_weights.with_dense`; None: the worker's ``auto``,
    :func:`worker.model.dense_weights.resolve_dense_min_rows`).

    Raises:
        FileNotFoundError / ValueError: see :func:`worker.model.loader.load_weights`;
            ValueError: an unknown dtype name, a cache dtype the device cannot use,
            a quantization it cannot run (:func:`worker.model.quantization.compute_dtype`),
            or ``dense_min_rows`` without ``gguf`` blocks multiplied in bfloat16; a truncated
            or corrupt GGUF file (:func:`worker.model.gguf_check.check_gguf_file`), or
            :class:`~worker.model.gguf_check.ModelTooLarge` for one that will not fit the memory left.
    """
    from worker.model.dtype import resolve_dtype, resolve_kv_cache_dtype
    from worker.model.gguf_check import check_fits_memory, check_gguf_file
    from worker.model.loader import load_weights
    from worker.model.dense_weights import resolve_dense_min_rows
    from worker.model.quantization import compute_dtype, gguf_bf16_activations, resolve_quantization

    is_gguf = Path(path).suffix == ".gguf" and Path(path).is_file()  # else load_weights says what is missing
    if is_gguf:
        check_gguf_file(path)  # a truncated or corrupt file in one line, before anything maps it
    quantization = resolve_quantization(quantization, path, dtype, device)
    imposed = compute_dtype(quantization, dtype, device)  # before the minute of loading
    if is_gguf:
        check_fits_memory(path, quantization, _host_kv_bytes(torch.device(device), num_blocks, kv_cache_bytes))
    bf16_activations = quantization == "gguf" and gguf_bf16_activations(dtype)
    auto_dense = dense_min_rows is None
    dense_min_rows = resolve_dense_min_rows(dense_min_rows, quantization, bf16_activations)
    config, weights = load_weights(path, keep_kquants=quantization == "gguf")
    formats = None
    if quantization == "gguf":
        from worker.model.gguf_loader import gguf_tensor_formats

        formats = gguf_tensor_formats(path)
    if auto_dense and dense_min_rows:
        tied = "lm_head.weight" not in weights or config.tie_word_embeddings
        dense_min_rows = _dense_rows_that_fit(dense_min_rows, config, formats, tied, bf16_activations)
    chosen = imposed or resolve_dtype(dtype, device, config.hidden_size, config.intermediate_size)
    cache_dtype = resolve_kv_cache_dtype(kv_cache_dtype, chosen, device, config.head_dim, quantization,
                                         bf16_activations)
    log.info("compute dtype %s (asked for %s), KV cache dtype %s (asked for %s), quantization %s%s",
             str(chosen).removeprefix("torch."), dtype, str(cache_dtype).removeprefix("torch."), kv_cache_dtype,
             quantization, " (block products with bfloat16 activations)" if bf16_activations else "")
    runner = build_runner(config, weights, dtype=chosen, device=device, block_size=block_size,
                          num_blocks=num_blocks, kv_cache_bytes=kv_cache_bytes, kv_cache_dtype=cache_dtype,
                          quantization=quantization, formats=formats, bf16_activations=bf16_activations,
                          dense_min_rows=dense_min_rows)
    _log_dense_products(runner.model)
    return runner


def dense_product_kinds(model: LlamaDecoder) -> list[str]:
    """The dense products a model's steps of ``model.dense_min_rows`` rows or more take, in words:
    bfloat16 copies of its Q4_1/Q8_0 blocks (memory) and tiles dequantized from its K-quant blocks
    per product (bfloat16 or float32, :func:`inflight_kernels.cpu_kquant_tiles`; no memory); empty
    when none."""
    weights = [model.lm_head] + [p for layer in model.layers for p in (layer.qkv, layer.o, layer.gate_up, layer.down)]
    kinds = []
    if any(getattr(p, "dense", None) is not None for p in weights):
        kinds.append("bfloat16 copies of the Q4_1/Q8_0 blocks, 2 bytes a weight")
    if any(isinstance(p, KQuantWeight) and p.dense_min_rows for p in weights):
        kinds.append(f"{inflight_kernels.cpu_kquant_tiles()} tiles dequantized from the K-quant blocks per product, no copy")
    return kinds


def _log_dense_products(model: LlamaDecoder) -> None:
    """One log line naming the dense products (:func:`dense_product_kinds`) the model's steps of many
    rows take, if any."""
    if not model.dense_min_rows:
        return
    log.info("dense products (%s) for steps of %d rows or more, where a row's result then depends on its "
             "step's row count (--dense-weights-min-rows; 0 or --deterministic turns them off)",
             "; ".join(dense_product_kinds(model)), model.dense_min_rows)


def _host_kv_bytes(device: torch.device, num_blocks: int | None, kv_cache_bytes: int | None) -> int:
    """Bytes of host memory the KV cache will take (0 on a GPU, or when sized by ``num_blocks``)."""
    if device.type != "cpu" or kv_cache_bytes is None and num_blocks is not None:
        return 0
    return DEFAULT_CPU_KV_BYTES if kv_cache_bytes is None else kv_cache_bytes


def _dense_rows_that_fit(dense_min_rows: int, config: ModelConfig, formats: dict[str, str] | None,
                         tied_lm_head: bool, copies: bool) -> int:
    """``auto``'s row count: the dense copies' unless they would crowd the host's memory
    (:func:`worker.model.dense_weights.fit_dense_to_memory`, counting only the weights that get a
    copy: :func:`worker.model.gguf_formats.copied_bytes` of ``formats``; says so in the log when
    not), and the K-quant tiles' own (:func:`~worker.model.dense_weights.kquant_auto_min_rows`)
    where no weight takes a copy (a K-quant file, or ``copies`` False: no bfloat16 activations)."""
    from worker.model.dense_weights import DENSE_MEMORY_SHARE, dense_copy_bytes, fit_dense_to_memory, kquant_auto_min_rows
    from worker.model.gguf_formats import copied_bytes
    from worker.model.host_memory import available_bytes

    copy_bytes = dense_copy_bytes(config) if formats is None else copied_bytes(config, formats, tied_lm_head)
    if copy_bytes == 0 or not copies:  # no copies: the K-quant tiles' own crossover
        return kquant_auto_min_rows()
    available = available_bytes()
    fitted = fit_dense_to_memory(dense_min_rows, copy_bytes, available)
    if not fitted:
        log.info("no dense bfloat16 copies of the GGUF blocks: they would take %.0f MiB, more than %.0f%% of the "
                 "%.0f MiB still available (--dense-weights-min-rows N makes them anyway)", copy_bytes / 2**20,
                 100 * DENSE_MEMORY_SHARE, available / 2**20)
    return fitted


def tiny_random_runner(seed: int = 0, vocab_size: int = 256, *, hidden_size: int = 64, num_layers: int = 2,
                       num_heads: int = 4, num_kv_heads: int = 2, intermediate_size: int = 128,
                       context_length: int = 1024, block_size: int = 16, num_blocks: int = 128,
                       attention_bias: bool = False, dtype: torch.dtype = torch.float32,
                       device: str = "cpu", kv_cache_dtype: torch.dtype | None = None,
                       quantization: str = "none", formats: dict[str, str] | None = None,
                       bf16_activations: bool = False, dense_min_rows: int = 0) -> ModelRunner:
    """A small random Llama (GQA by default) for fast engine tests; same seed,
    same weights. See :func:`worker.model.random_weights.random_llama_weights`.
    ``formats``: with ``quantization="gguf"``, the GGUF type each HF-named weight
    is to be treated as having (as :func:`worker.model.gguf_loader.gguf_tensor_formats`), and
    ``bf16_activations`` whether its Q4_1 and Q8_0 products round the activations to bfloat16
    (and ``dense_min_rows`` as for :func:`build_runner`)."""
    from worker.model.random_weights import random_llama_weights

    config = ModelConfig(hidden_size=hidden_size, num_layers=num_layers, num_heads=num_heads,
                         num_kv_heads=num_kv_heads, head_dim=hidden_size // num_heads,
                         intermediate_size=intermediate_size, vocab_size=vocab_size, context_length=context_length,
                         attention_bias=attention_bias)
    return build_runner(config, random_llama_weights(config, seed), dtype=dtype, device=device,
                        block_size=block_size, num_blocks=num_blocks, kv_cache_bytes=None,
                        kv_cache_dtype=kv_cache_dtype, quantization=quantization, formats=formats,
                        bf16_activations=bf16_activations, dense_min_rows=dense_min_rows)
