"""Gemma 2, Gemma 3 and Mistral from GGUF files in llama.cpp's layout, written with gguf's own
writer as convert_hf_to_gguf.py writes them: Gemma's norms stored as ``1 + w``, its sandwich
norms as ``post_attention_norm``/``post_ffw_norm``, no ``output.weight`` (tied), the soft-caps
and the sliding window in the header, Gemma 3's global RoPE base and linear scaling there too
while its local base and layer pattern are llama.cpp's fixed ones; Mistral as arch ``llama``
(q/k rows permuted) with ``llama.attention.sliding_window``. Each loads and computes what
transformers computes from the same (dequantized) weights: a prefill and one decode step, with
windows shorter than the sequence, float32 or Q8_0 weights under ``--quantization none`` and
Q4_K/Q6_K blocks under ``auto`` (kept as blocks). The header alone gives the ModelConfig that
hf_config gives for the published ``config.json``; an IQ4_XS tensor is still refused."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from worker.model.gguf_loader import gguf_config
from worker.model.hf_config import hf_config
from worker.model.model_runner import load_model_runner
from worker.runner_io import ModelInput, ScheduledChunk

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")

HIDDEN, HEADS, KV_HEADS, INTER, VOCAB, WINDOW = 256, 4, 2, 256, 64, 4
HEAD_DIM = HIDDEN // HEADS
IDS = [5, 17, 3, 60, 22, 9, 41, 33, 8, 2, 50, 12]
LAYERS = {"gemma2": 3, "gemma3": 7, "llama": 2}  # gemma3: layer 5 is global, 0-4 and 6 slide
# offset of each K block's float16 scale(s) within the block (ggml-common.h block_q4_K, _q6_K)
_F16_FIELDS = {"Q4_K": (0, 2), "Q6_K": (208,)}


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/worker/conftest.py


def _blocks(kind: str, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """``[rows, cols]`` values (F32) or uint8 ``[rows, bytes]`` of valid ``kind`` blocks: K blocks are
    random bytes with small finite scales (gguf-py cannot quantize K types)."""
    if kind == "F32":
        return (rng.standard_normal((rows, cols)) / cols**0.5).astype(np.float32)
    qtype = gguf.GGMLQuantizationType[kind]
    if kind == "Q8_0":
        return gguf.quants.quantize((rng.standard_normal((rows, cols)) / cols**0.5).astype(np.float32), qtype)
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
    for offset in _F16_FIELDS[kind]:
        scale = (rng.uniform(0.5, 1.0, (rows, cols // block)) * 2e-3).astype(np.float16)
        raw[:, :, offset:offset + 2] = scale.view(np.uint8).reshape(rows, cols // block, 2)
    return raw.reshape(rows, -1)


def _hf_order(w: torch.Tensor, heads: int) -> torch.Tensor:
    """The inverse of convert_hf_to_gguf.py ``LlamaModel.permute`` (HF q/k rows to llama.cpp's
    interleaved order): the HF rows of what the file holds."""
    return w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _write(path, arch: str, kinds: list[str], vocab=None) -> dict[str, torch.Tensor]:
    """A tiny ``arch`` GGUF as llama.cpp's converter writes it, projections in ``kinds`` in turn;
    returns the HF-named float32 weights (dequantized; Gemma's norms as HF's ``w``). ``vocab``
    (tests.helpers.sentencepiece_gguf.SentencePieceVocab): that SentencePiece vocabulary in the
    header, as Gemma's converter writes it (no space prefix), and one embedding row per token."""
    rng = np.random.default_rng(0)
    gemma = arch != "llama"
    vocab_rows = len(vocab.tokens) if vocab is not None else VOCAB
    writer = gguf.GGUFWriter(str(path), arch)
    if vocab is not None:
        from tests.helpers.sentencepiece_gguf import add_sentencepiece_vocab

        add_sentencepiece_vocab(writer, vocab, add_space_prefix=not gemma)
    writer.add_context_length(256)
    writer.add_embedding_length(HIDDEN)
    writer.add_block_count(LAYERS[arch])
    writer.add_feed_forward_length(INTER)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_key_length(HEAD_DIM)
    writer.add_value_length(HEAD_DIM)
    writer.add_sliding_window(WINDOW)
    if arch == "gemma2":  # Gemma2Model.set_gguf_parameters: no RoPE base (10000)
        writer.add_attn_logit_softcapping(5.0)
        writer.add_final_logit_softcapping(3.0)
    else:
        writer.add_rope_freq_base(1_000_000.0 if arch == "gemma3" else 10000.0)
    if arch == "gemma3":  # the 4B's: the global layers' only
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(8.0)
    hf: dict[str, torch.Tensor] = {}
    turn = iter(range(10**6))

    def matrix(gguf_name: str, hf_name: str, rows: int, cols: int, heads: int = 0) -> None:
        kind = kinds[next(turn) % len(kinds)]
        raw = _blocks(kind, rows, cols, rng)
        qtype = gguf.GGMLQuantizationType[kind]
        writer.add_tensor(gguf_name, raw, raw_dtype=None if kind == "F32" else qtype)
        values = torch.from_numpy(gguf.quants.dequantize(raw, qtype).copy())
        hf[hf_name] = _hf_order(values, heads) if heads else values

    def norm(gguf_name: str, hf_name: str, size: int) -> None:
        w = (0.1 * rng.standard_normal(size)).astype(np.float32)
        stored = w + 1  # Gemma: llama.cpp stores 1 + w; Llama's norms are w ~ 1 themselves
        writer.add_tensor(gguf_name, stored)
        hf[hf_name] = torch.from_numpy(w if gemma else stored)

    matrix("token_embd.weight", "model.embed_tokens.weight", vocab_rows, HIDDEN)
    if not gemma:
        matrix("output.weight", "lm_head.weight", vocab_rows, HIDDEN)
    norm("output_norm.weight", "model.norm.weight", HIDDEN)
    q, kv = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    for i in range(LAYERS[arch]):
        blk, hf_blk = f"blk.{i}.", f"model.layers.{i}."
        matrix(blk + "attn_q.weight", hf_blk + "self_attn.q_proj.weight", q, HIDDEN, 0 if gemma else HEADS)
        matrix(blk + "attn_k.weight", hf_blk + "self_attn.k_proj.weight", kv, HIDDEN, 0 if gemma else KV_HEADS)
        matrix(blk + "attn_v.weight", hf_blk + "self_attn.v_proj.weight", kv, HIDDEN)
        matrix(blk + "attn_output.weight", hf_blk + "self_attn.o_proj.weight", HIDDEN, q)
        matrix(blk + "ffn_gate.weight", hf_blk + "mlp.gate_proj.weight", INTER, HIDDEN)
        matrix(blk + "ffn_up.weight", hf_blk + "mlp.up_proj.weight", INTER, HIDDEN)
        matrix(blk + "ffn_down.weight", hf_blk + "mlp.down_proj.weight", HIDDEN, INTER)
        norm(blk + "attn_norm.weight", hf_blk + "input_layernorm.weight", HIDDEN)
        if gemma:
            norm(blk + "post_attention_norm.weight", hf_blk + "post_attention_layernorm.weight", HIDDEN)
            norm(blk + "ffn_norm.weight", hf_blk + "pre_feedforward_layernorm.weight", HIDDEN)
            norm(blk + "post_ffw_norm.weight", hf_blk + "post_feedforward_layernorm.weight", HIDDEN)
        else:
            norm(blk + "ffn_norm.weight", hf_blk + "post_attention_layernorm.weight", HIDDEN)
        if arch == "gemma3":
            norm(blk + "attn_q_norm.weight", hf_blk + "self_attn.q_norm.weight", HEAD_DIM)
            norm(blk + "attn_k_norm.weight", hf_blk + "self_attn.k_norm.weight", HEAD_DIM)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return hf


def _hf_model(arch: str):
    common = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTER, num_hidden_layers=LAYERS[arch],
                  num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=256,
                  rms_norm_eps=1e-6, sliding_window=WINDOW)
    if arch == "gemma2":
        config = transformers.Gemma2Config(**common, head_dim=HEAD_DIM, query_pre_attn_scalar=HEAD_DIM,
                                           attn_logit_softcapping=5.0, final_logit_softcapping=3.0)
        model = transformers.Gemma2ForCausalLM
    elif arch == "gemma3":
        config = transformers.Gemma3TextConfig(**common, head_dim=HEAD_DIM, query_pre_attn_scalar=HEAD_DIM,
                                               rope_theta=1_000_000.0, rope_local_base_freq=10000.0,
                                               rope_scaling={"rope_type": "linear", "factor": 8.0})
        assert config.layer_types[5] == "full_attention" and config.layer_types.count("full_attention") == 1
        model = transformers.Gemma3ForCausalLM
    else:
        config = transformers.MistralConfig(**common, rope_theta=10000.0, tie_word_embeddings=False)
        model = transformers.MistralForCausalLM
    return model._from_config(config, attn_implementation="eager").eval()


def _hf_logits(arch: str, weights: dict[str, torch.Tensor]) -> torch.Tensor:
    model = _hf_model(arch)
    missing, unexpected = model.load_state_dict(weights, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)  # Gemma: tied
    with torch.no_grad():
        return model(torch.tensor([IDS])).logits[0]


def _ours(path, quantization: str) -> torch.Tensor:
    runner = load_model_runner(path, dtype="float32", kv_cache_dtype="float32", block_size=8, num_blocks=4,
                               quantization=quantization)
    prefill = runner.execute(ModelInput(prefills=[ScheduledChunk(0, IDS[:-1], 0, [3, 1])])).logits[0]
    decode = runner.execute(ModelInput(decodes=[ScheduledChunk(0, IDS[-1:], len(IDS) - 1, [3, 1])])).logits[0]
    return torch.stack([prefill, decode])


@pytest.mark.parametrize("arch", ["gemma2", "gemma3", "llama"], ids=["gemma2", "gemma3", "mistral"])
@pytest.mark.parametrize("kinds", [["F32"], ["Q8_0"]])
def test_gguf_matches_transformers(tmp_path, arch, kinds):
    path = tmp_path / f"{arch}.gguf"
    weights = _write(path, arch, kinds)
    expected = _hf_logits(arch, weights)
    torch.testing.assert_close(_ours(path, "none"), expected[-2:], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
def test_gemma_k_quants_kept_as_blocks_match_transformers(tmp_path, arch):
    """``auto`` keeps the Q4_K/Q6_K blocks (the K-quant GEMM rounds activations to int16 per 256
    values: the tolerance of test_gguf_quant_types.py); ``none`` dequantizes them exactly."""
    path = tmp_path / f"{arch}.gguf"
    weights = _write(path, arch, ["Q4_K", "Q6_K"])
    expected = _hf_logits(arch, weights)[-2:]
    torch.testing.assert_close(_ours(path, "none"), expected, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(_ours(path, "auto"), expected, rtol=1e-4, atol=2e-3 * expected.abs().max().item())


@pytest.mark.parametrize("arch", ["gemma3", "llama"], ids=["gemma3", "mistral"])
def test_a_sentencepiece_vocabulary_serves_through_the_worker_and_the_gateway(tmp_path, arch):
    """A Gemma 3 (no space prefix) or Mistral (llama.cpp's prefix) file carrying a real
    SentencePiece vocabulary (``tokenizer.ggml.model = "llama"``, refused before): the worker's
    own ``build_engine`` loads it, BOS is added as the header says, the prompt's ids are
    SentencePiece's, greedy decoding runs and its streamed text continues the prompt's; the
    gateway's ``load_tokenizer`` counts the same ids."""
    from gateway.main import load_tokenizer as gateway_tokenizer
    from gateway.settings import GatewaySettings
    from tests.helpers.sentencepiece_gguf import processor, trained_vocab
    from worker.engine.engine_types import EngineRequest
    from worker.engine.sampling_params import SamplingParams
    from worker.serve.main import build_engine
    from worker.serve.settings import WorkerSettings

    vocab = trained_vocab()
    path = tmp_path / f"{arch}-spm.gguf"
    _write(path, arch, ["Q8_0"], vocab=vocab)
    engine, name = build_engine(WorkerSettings(model=str(path), device="cpu", dtype="float32",
                                               kv_cache_dtype="float32", kv_cache_bytes=1 << 22))
    tokenizer = engine.tokenizer
    text = "🤗 Beautiful is better than ugly.\n  Simple is better"
    ids = tokenizer.encode(text, add_special_tokens=True)
    assert ids == [vocab.bos_id, *processor(vocab, add_dummy_prefix=arch == "llama").encode(text)]
    assert gateway_tokenizer(GatewaySettings(model_path=str(path))).encode(text, add_special_tokens=True) == ids
    engine.add_request(EngineRequest("r", ids, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)))
    streamed, out_ids = "", []
    for _ in range(50):
        for out in engine.step():
            streamed, out_ids = streamed + out.text_delta, out_ids + list(out.token_ids)
        if not engine.has_unfinished():
            break
    assert name == path.stem and len(out_ids) == 6
    assert tokenizer.decode(ids + out_ids) == tokenizer.decode(ids) + streamed  # the prompt's tail is context


def _published_gguf_meta(arch: str, **values) -> dict:
    return {"general.architecture": arch, **{f"{arch}.{key}": value for key, value in values.items()}}


def test_header_gives_hf_configs_model_config(tmp_path):
    """gemma-2-27b (its attention scale from hidden/heads, as llama.cpp tells it by its 46
    blocks), gemma-3-4b (linear 8 on the global layers) and Mistral-7B-v0.1's headers, as the
    converter writes them, against their ``config.json``."""
    from dataclasses import replace

    gemma2_27b = _published_gguf_meta(
        "gemma2", context_length=8192, embedding_length=4608, block_count=46, feed_forward_length=36864,
        **{"attention.head_count": 32, "attention.head_count_kv": 16, "attention.layer_norm_rms_epsilon": 1e-6,
           "attention.key_length": 128, "attention.value_length": 128, "attn_logit_softcapping": 50.0,
           "final_logit_softcapping": 30.0, "attention.sliding_window": 4096})
    hf_gemma2 = dict(model_type="gemma2", hidden_size=4608, num_hidden_layers=46, intermediate_size=36864,
                     num_attention_heads=32, num_key_value_heads=16, head_dim=128, vocab_size=256000,
                     max_position_embeddings=8192, rms_norm_eps=1e-6, rope_theta=10000.0,
                     attn_logit_softcapping=50.0, final_logit_softcapping=30.0, query_pre_attn_scalar=144,
                     sliding_window=4096, hidden_activation="gelu_pytorch_tanh")
    gemma3_4b = _published_gguf_meta(
        "gemma3", context_length=131072, embedding_length=2560, block_count=34, feed_forward_length=10240,
        **{"attention.head_count": 8, "attention.head_count_kv": 4, "attention.layer_norm_rms_epsilon": 1e-6,
           "attention.key_length": 256, "attention.value_length": 256, "rope.freq_base": 1_000_000.0,
           "attention.sliding_window": 1024, "rope.scaling.type": "linear", "rope.scaling.factor": 8.0})
    hf_gemma3 = dict(model_type="gemma3_text", hidden_size=2560, num_hidden_layers=34, intermediate_size=10240,
                     num_attention_heads=8, num_key_value_heads=4, head_dim=256, vocab_size=262208,
                     max_position_embeddings=131072, rms_norm_eps=1e-6, rope_theta=1_000_000.0,
                     rope_local_base_freq=10000.0, rope_scaling={"rope_type": "linear", "factor": 8.0},
                     query_pre_attn_scalar=256, sliding_window=1024, sliding_window_pattern=6,
                     hidden_activation="gelu_pytorch_tanh", final_logit_softcapping=None,
                     attn_logit_softcapping=None)
    mistral = _published_gguf_meta(
        "llama", context_length=32768, embedding_length=4096, block_count=32, feed_forward_length=14336,
        **{"attention.head_count": 32, "attention.head_count_kv": 8, "attention.layer_norm_rms_epsilon": 1e-5,
           "rope.freq_base": 10000.0, "attention.sliding_window": 4096})
    hf_mistral = dict(model_type="mistral", hidden_size=4096, num_hidden_layers=32, intermediate_size=14336,
                      num_attention_heads=32, num_key_value_heads=8, vocab_size=32000, max_position_embeddings=32768,
                      rms_norm_eps=1e-5, rope_theta=10000.0, sliding_window=4096, tie_word_embeddings=False)
    for meta, raw in ((gemma2_27b, hf_gemma2), (gemma3_4b, hf_gemma3), (mistral, hf_mistral)):
        ours, theirs = gguf_config(meta, tmp_path / "m.gguf"), hf_config(raw)
        assert ours.attention_scale == theirs.attention_scale
        # what the file leaves to the loader's tensors (vocabulary, tied head) or only names
        ours = replace(ours, vocab_size=theirs.vocab_size, tie_word_embeddings=theirs.tie_word_embeddings,
                       architecture=theirs.architecture, query_pre_attn_scalar=theirs.query_pre_attn_scalar)
        assert ours == theirs, raw["model_type"]
    gemma3 = gguf_config(gemma3_4b, tmp_path / "m.gguf")
    assert [gemma3.window(i) for i in range(12)] == [1024] * 5 + [0] + [1024] * 5 + [0]
    assert gemma3.layer_rope(0).theta == 10000.0 and gemma3.layer_rope(0).rope_type == "default"
    assert gemma3.layer_rope(5).theta == 1_000_000.0 and gemma3.layer_rope(5).factor == 8.0
    gemma2_2b = dict(gemma2_27b, **{"gemma2.block_count": 26})  # any other size: 1/sqrt(head_dim)
    assert gguf_config(gemma2_2b, tmp_path / "m.gguf").attention_scale == 128**-0.5


def test_an_iq4_xs_tensor_is_refused_in_one_line(tmp_path):
    """IQ4_XS (no real Gemma, Llama, Qwen or Phi-3 file here to check a kernel against)."""
    path = tmp_path / "iq4xs.gguf"
    writer = gguf.GGUFWriter(str(path), "gemma3")
    qtype = gguf.GGMLQuantizationType.IQ4_XS
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    writer.add_tensor("token_embd.weight", np.zeros((4, HIDDEN // block * size), np.uint8), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match=r"^iq4xs\.gguf: tensor 'token_embd\.weight' has type IQ4_XS, unsupported "
                                         r"\(supported: F32, [^\n]*Q6_K\)$"):
        load_model_runner(path, dtype="float32", num_blocks=4)
