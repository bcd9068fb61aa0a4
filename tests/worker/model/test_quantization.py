"""--quantization q8_0: where it may run, and the decoder with Q8_0 projections
against the same decoder computing each projection with the oracle."""

from types import SimpleNamespace
from unittest import mock

import pytest
import torch

import worker.model.llama as llama
from inflight_kernels import reference
from inflight_kernels.cpu import ops as cpu_ops
from worker.runner_io import ModelInput, ScheduledChunk
from worker.model.block_weights import Q4Weight, Q8Weight
from worker.model.quantization import compute_dtype
from worker.model.model_runner import tiny_random_runner


def test_compute_dtype():
    assert compute_dtype("none", "bfloat16", "cpu") is None
    assert compute_dtype("q8_0", "auto", "cpu") == torch.float32
    assert compute_dtype("q8_0", torch.float32, "cpu") == torch.float32
    with pytest.raises(ValueError, match="computes in float32"):
        compute_dtype("q8_0", "bfloat16", "cpu")
    with pytest.raises(ValueError, match="CPU only"):
        compute_dtype("q8_0", "auto", "cuda")
    with pytest.raises(ValueError, match="unknown quantization 'q4'"):
        compute_dtype("q4", "auto", "cpu")


def test_gguf_with_bfloat16_rounds_only_the_q4_1_products_activations():
    from worker.model.quantization import gguf_bf16_activations

    with mock.patch("inflight_kernels.cpu_dequant_bf16", return_value=True):
        assert compute_dtype("gguf", "bfloat16", "cpu") == torch.float32  # the rest stays float32
        assert gguf_bf16_activations("bfloat16") and not gguf_bf16_activations("float32")
        for has_bf16 in (True, False):
            with mock.patch("worker.model.dtype.cpu_has_bf16", return_value=has_bf16):
                assert gguf_bf16_activations("auto") == has_bf16
    with mock.patch("inflight_kernels.cpu_dequant_bf16", return_value=False):
        with pytest.raises(ValueError, match="needs a CPU with AVX-512 BF16"):
            compute_dtype("gguf", "bfloat16", "cpu")
        with mock.patch("worker.model.dtype.cpu_has_bf16", return_value=True):
            assert not gguf_bf16_activations("auto")
    with pytest.raises(ValueError, match="computes in float32"):
        compute_dtype("gguf", "float16", "cpu")


def test_q8_weight_needs_whole_blocks_and_counts_its_bytes():
    with pytest.raises(ValueError, match="multiples of 32"):
        Q8Weight.quantize(torch.zeros(8, 40))
    weight = Q8Weight.quantize(torch.randn(13, 64))
    assert weight.shape == (13, 64)
    assert weight.nbytes == 2 * 2 * 288 + 4 * 2 * 2 * 8  # 2 tiles x 2 blocks (weights + compensations, scales)


def _oracle_linear(x, weight, bias=None):
    """What a Q8Weight or Q4Weight computes, through inflight_kernels.reference on the float weight it came from."""
    oracle = reference.q4_1_linear if isinstance(weight, Q4Weight) else reference.q8_0_linear
    out = oracle(x.float(), _FLOAT[id(weight)])
    return out if bias is None else out + bias


_FLOAT: dict[int, torch.Tensor] = {}


def _prefill_logits(runner, ids):
    chunk = ScheduledChunk(0, ids, 0, list(range(-(-len(ids) // runner.block_size))))
    return runner.execute(ModelInput(prefills=[chunk])).logits


@pytest.mark.parametrize("quantization, projection", [("q8_0", Q8Weight), ("q4_1", Q4Weight)])
@pytest.mark.parametrize("attention_bias", [False, True])
def test_quantized_decoder_matches_the_oracle_and_stays_near_float32(attention_bias, quantization, projection):
    assert cpu_ops.available()
    plain = tiny_random_runner(seed=3, attention_bias=attention_bias)
    runner = tiny_random_runner(seed=3, attention_bias=attention_bias, quantization=quantization)
    model = runner.model
    assert model.quantization == quantization and isinstance(model.lm_head, Q8Weight)
    assert all(isinstance(getattr(layer, name), projection) for layer in model.layers
               for name in ("qkv", "o", "gate_up", "down"))
    ids = list(range(5, 45))
    got = _prefill_logits(runner, ids)
    # The oracle: the same random float weights, each projection through reference.q8_0_linear.
    oracle = tiny_random_runner(seed=3, attention_bias=attention_bias)
    for q8_layer, layer in zip(model.layers, oracle.model.layers):
        for name in ("qkv", "o", "gate_up", "down"):
            dense = getattr(layer, name)
            _FLOAT[id(getattr(q8_layer, name))] = dense.to_dense() if dense.layout == torch._mkldnn else dense
    lm_head = oracle.model.lm_head
    _FLOAT[id(model.lm_head)] = lm_head.to_dense() if lm_head.layout == torch._mkldnn else lm_head
    with mock.patch.object(llama, "linear", _oracle_linear):
        want = _prefill_logits(runner, ids)  # same runner, same Q8Weight objects, oracle arithmetic
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    base = _prefill_logits(plain, ids)
    # quantized, not a different model (4 bits: 16 levels per block of 32 random weights)
    assert (got - base).abs().max() < (0.05 if quantization == "q8_0" else 0.25) * base.abs().max()


@pytest.mark.parametrize("quantization", ["q8_0", "q4_1"])
def test_quantized_decoder_refuses_other_dtypes(quantization):
    with pytest.raises(ValueError, match=f"{quantization} runs float32 on the CPU"):
        tiny_random_runner(seed=0, dtype=torch.bfloat16, quantization=quantization)


def test_auto_is_gguf_for_a_gguf_file_on_the_cpu(tmp_path):
    from worker.model import quantization
    from worker.model.quantization import resolve_quantization

    kept = {"model.layers.0.self_attn.q_proj.weight": "q4_1", "model.layers.0.mlp.down_proj.weight": "q8_0",
            "model.embed_tokens.weight": "q6_k", "model.norm.weight": "f32"}
    k_quant = dict(kept, **{"model.layers.0.mlp.down_proj.weight": "q6_k"})  # K-quants run in their own blocks
    with mock.patch("worker.model.gguf_loader.gguf_tensor_formats", return_value=k_quant):
        assert resolve_quantization("auto", "model.gguf", "auto", "cpu") == "gguf"
    half = dict(kept, **{"model.layers.0.mlp.down_proj.weight": "f16"})
    with mock.patch("worker.model.gguf_loader.gguf_tensor_formats", return_value=half):
        assert resolve_quantization("auto", "model.gguf", "auto", "cpu") == "none"
        assert resolve_quantization("gguf", "model.gguf", "auto", "cpu") == "gguf"  # asked for: partly kept
    with mock.patch("worker.model.gguf_loader.gguf_tensor_formats", return_value=kept):
        assert quantization._all_projections_kept("model.gguf")
        assert resolve_quantization("auto", "model.gguf", "auto", "cpu") == "gguf"
        assert resolve_quantization("auto", "model.gguf", "float32", "cpu") == "gguf"
        for has_bf16 in (True, False):  # bfloat16: only where the Q4_1 products can take bfloat16 activations
            with mock.patch("inflight_kernels.cpu_dequant_bf16", return_value=has_bf16):
                assert resolve_quantization("auto", "model.gguf", "bfloat16", "cpu") == ("gguf" if has_bf16 else "none")
        assert resolve_quantization("auto", "model.gguf", "float16", "cpu") == "none"
        assert resolve_quantization("auto", "model.gguf", "auto", "cuda") == "none"
        assert resolve_quantization("auto", tmp_path, "auto", "cpu") == "none"  # a safetensors folder
        assert resolve_quantization("q8_0", tmp_path, "auto", "cpu") == "q8_0"
        with pytest.raises(ValueError, match="not a .gguf file"):
            resolve_quantization("gguf", tmp_path, "auto", "cpu")
        with mock.patch("inflight_kernels.cpu_kernels_available", return_value=False):
            assert resolve_quantization("auto", "model.gguf", "auto", "cpu") == "none"


def test_a_fused_projection_keeps_blocks_only_when_all_its_parts_share_a_kept_type():
    from worker.model.gguf_formats import layer_formats, projection_format

    assert projection_format({"a": "q4_1", "b": "q4_1"}, ["a", "b", "c"]) == "q4_1"
    assert projection_format({"a": "q8_0"}, ["a"]) == "q8_0"
    assert projection_format({"a": "q4_1", "b": "q8_0"}, ["a", "b"]) is None  # not re-quantized
    assert projection_format({"a": "q4_k"}, ["a"]) is None
    assert projection_format({}, ["a"]) is None
    p = "model.layers.2."
    formats = {p + "self_attn.q_proj.weight": "q4_1", p + "self_attn.k_proj.weight": "q4_1",
               p + "self_attn.v_proj.weight": "q6_k", p + "self_attn.o_proj.weight": "q4_1",
               p + "mlp.gate_up_proj.weight": "q8_0", p + "mlp.down_proj.weight": "f16",
               "model.embed_tokens.weight": "q8_0", "lm_head.weight": "q4_1"}
    assert layer_formats(formats, 2, tied_lm_head=True) == {"qkv": None, "o": "q4_1", "gate_up": "q8_0",
                                                             "down": None, "lm_head": "q8_0"}
    assert layer_formats(formats, 2, tied_lm_head=False)["lm_head"] == "q4_1"


def test_gguf_keeps_the_default_files_blocks_weight_only_and_answers_like_float32():
    """The default model: its Q4_1 projections and Q8_0 lm_head are kept as blocks (the
    file's bytes, 5 bits per projection weight), weight-only. With ``--dtype float32`` its
    logits stay within float32 rounding of the dense float32 model's; under the default
    settings on a CPU with bfloat16 math the Q4_1 products round their activations to
    bfloat16, which moves them more, yet far less than the int8-activation q4_1 does."""
    from common.model_files import default_model_path
    from worker.model.model_runner import load_model_runner
    from worker.model.quantization import gguf_bf16_activations

    path = default_model_path()
    if not path.exists():
        pytest.skip(f"no model at {path}")
    runner = load_model_runner(path, num_blocks=16, dtype="float32")
    model = runner.model
    assert model.quantization == "gguf" and model.dtype == torch.float32
    assert all(isinstance(getattr(layer, name), Q4Weight) and getattr(layer, name).float_activations
               and not getattr(layer, name).bf16_activations
               for layer in model.layers for name in ("qkv", "o", "gate_up", "down"))
    assert isinstance(model.lm_head, Q8Weight) and model.lm_head.float_activations
    ids = list(range(1000, 1040))
    got = _prefill_logits(runner, ids)
    dense = _prefill_logits(load_model_runner(path, quantization="none", dtype="float32", num_blocks=16), ids)
    int8 = _prefill_logits(load_model_runner(path, quantization="q4_1", num_blocks=16), ids)
    gap, int8_gap = (got - dense).abs().max(), (int8 - dense).abs().max()
    assert gap < 2e-3 * dense.abs().max() and gap * 20 < int8_gap, (gap, int8_gap)
    default = load_model_runner(path, num_blocks=16)
    assert default.model.quantization == "gguf"
    assert default.model.layers[0].gate_up.bf16_activations == gguf_bf16_activations("auto")
    if gguf_bf16_activations("auto"):
        bf16_gap = (_prefill_logits(default, ids) - dense).abs().max()
        assert gap < bf16_gap and bf16_gap * 2 < int8_gap, (gap, bf16_gap, int8_gap)


DENSE = pytest.mark.skipif(not (__import__("inflight_kernels").cpu_dequant_bf16()
                                 and __import__("inflight_kernels").cpu_bf16_gemm()),
                           reason="no AVX-512 BF16 build on this CPU")


@DENSE
@pytest.mark.parametrize("onednn", [False, True], ids=["bf16-gemm", "onednn-as-on-amx"])
@pytest.mark.parametrize("block_format", ["q4_1", "q8_0"])
def test_a_dense_copy_serves_steps_of_many_rows_and_the_blocks_the_others(block_format, onednn):
    from worker.model.gguf_formats import gguf_converter

    torch.manual_seed(3)
    float_weight = torch.randn(40, 96) * 0.1
    rounded = (reference.q4_1_round if block_format == "q4_1" else reference.q8_0_round)(float_weight)
    blocks = gguf_converter(block_format, None, bf16_activations=True)(rounded)
    with mock.patch("worker.model.dtype.cpu_has_amx", return_value=onednn):
        dense = gguf_converter(block_format, None, bf16_activations=True, dense_min_rows=4)(rounded)
    assert blocks.dense is None and (dense.dense.layout == torch._mkldnn) == onednn
    assert dense.nbytes == blocks.nbytes + 2 * 40 * 96 and dense.block_nbytes == blocks.nbytes  # 2 bytes per weight
    few, many = torch.randn(3, 96), torch.randn(4, 96)
    assert torch.equal(dense(few), blocks(few))  # below the threshold: the blocks, bit for bit
    # from it: the bfloat16-rounded weights times the bfloat16-rounded activations, float32 sums
    # (oneDNN's rounded to bfloat16 on the way out)
    want = (many.bfloat16().double() @ rounded.bfloat16().double().T).float()
    if onednn:
        assert torch.equal(dense(many), dense(many).bfloat16().float())
    torch.testing.assert_close(dense(many), want, rtol=2 ** -8 if onednn else 1e-5, atol=1e-5)
    assert not torch.equal(dense(many), blocks(many))
    torch.testing.assert_close(dense(many), blocks(many), rtol=0.02, atol=0.02)


def test_auto_gives_dense_copies_wherever_the_bfloat16_gemm_runs():
    from worker.model.dense_weights import AUTO_DENSE_MIN_ROWS, resolve_dense_min_rows

    for built, want in ((True, AUTO_DENSE_MIN_ROWS), (False, 0)):
        with mock.patch("inflight_kernels.cpu_bf16_gemm", return_value=built), \
                mock.patch("inflight_kernels.cpu_kquant_tiles", return_value="bfloat16" if built else None):
            for amx in (True, False):  # AMX CPUs and AVX-512 BF16 ones alike (runs 34 and 35)
                with mock.patch("worker.model.dtype.cpu_has_amx", return_value=amx):
                    assert resolve_dense_min_rows(None, "gguf", True) == want
                    assert resolve_dense_min_rows(None, "gguf", False) == 0  # float32 activations
                    assert resolve_dense_min_rows(None, "none", False) == 0
                    assert resolve_dense_min_rows(0, "gguf", True) == 0
                    with pytest.raises(ValueError, match="needs --quantization gguf"):
                        resolve_dense_min_rows(8, "none", False)
    with mock.patch("inflight_kernels.cpu_bf16_gemm", return_value=True):
        assert resolve_dense_min_rows(8, "gguf", True) == 8


def test_auto_gives_the_float32_kquant_tiles_their_own_count_on_avx2():
    """On a CPU with AVX2 and no AVX-512 BF16 (float32 activations, no copies) auto is the float32
    K-quant tiles' crossover for gguf, and an explicit count is taken (it acts on K-quant weights)."""
    from worker.model.dense_weights import AUTO_KQUANT_MIN_ROWS, resolve_dense_min_rows

    with mock.patch("inflight_kernels.cpu_bf16_gemm", return_value=False), \
            mock.patch("inflight_kernels.cpu_kquant_tiles", return_value="float32"):
        assert resolve_dense_min_rows(None, "gguf", False) == AUTO_KQUANT_MIN_ROWS["float32"]
        assert resolve_dense_min_rows(None, "none", False) == 0
        assert resolve_dense_min_rows(12, "gguf", False) == 12
        with pytest.raises(ValueError, match="needs --quantization gguf"):
            resolve_dense_min_rows(12, "q8_0", False)
    # bfloat16 tiles need bfloat16 activations: --dtype float32 keeps them off
    with mock.patch("inflight_kernels.cpu_bf16_gemm", return_value=True), \
            mock.patch("inflight_kernels.cpu_kquant_tiles", return_value="bfloat16"):
        assert resolve_dense_min_rows(None, "gguf", False) == 0


def test_dense_copy_bytes_counts_two_bytes_per_projection_and_lm_head_weight():
    from worker.model.model_config import ModelConfig
    from worker.model.dense_weights import dense_copy_bytes

    smollm2 = ModelConfig(hidden_size=576, num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64,
                          intermediate_size=1536, vocab_size=49152)
    per_layer = 576 * 576 * 2 + 576 * 192 * 2 + 3 * 576 * 1536  # q, o; k, v; gate, up, down
    assert dense_copy_bytes(smollm2) == 2 * (30 * per_layer + 49152 * 576) == 268_959_744


def test_auto_drops_the_dense_copies_that_would_crowd_memory():
    from worker.model.dense_weights import DENSE_MEMORY_SHARE, fit_dense_to_memory

    copies = 269_000_000
    assert fit_dense_to_memory(16, copies, 20 * 2**30) == 16
    assert fit_dense_to_memory(16, copies, int(copies / DENSE_MEMORY_SHARE) + 1) == 16
    assert fit_dense_to_memory(16, copies, int(copies / DENSE_MEMORY_SHARE) - 4) == 0
    assert fit_dense_to_memory(16, copies, None) == 16  # memory unknown: kept
    assert fit_dense_to_memory(0, copies, 2**40) == 0


def test_load_model_runner_checks_auto_copies_against_memory_and_leaves_an_explicit_count(monkeypatch):
    """The model's size is only known once loaded: auto (None) is checked then, a count is not."""
    import worker.model.host_memory as host_memory
    import worker.model.model_runner as model_runner
    from worker.model.model_config import ModelConfig

    seen = []
    config = ModelConfig(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                         intermediate_size=128, vocab_size=256)
    monkeypatch.setattr("worker.model.quantization.resolve_quantization", lambda *a: "gguf")
    monkeypatch.setattr("worker.model.quantization.compute_dtype", lambda *a: torch.float32)
    monkeypatch.setattr("worker.model.quantization.gguf_bf16_activations", lambda dtype: True)
    monkeypatch.setattr("inflight_kernels.cpu_bf16_gemm", lambda: True)
    monkeypatch.setattr("inflight_kernels.cpu_kquant_tiles", lambda: "bfloat16")
    monkeypatch.setattr("worker.model.loader.load_weights", lambda path, keep_kquants=False: (config, {}))
    names = ["model.embed_tokens.weight"] + [f"model.layers.{i}.{m}.{p}_proj.weight" for i in range(2)
                                             for m, ps in (("self_attn", "qkvo"), ("mlp", ("gate", "up", "down")))
                                             for p in ps]
    built = SimpleNamespace(model=SimpleNamespace(dense_min_rows=0))  # what the log line reads
    monkeypatch.setattr(model_runner, "build_runner", lambda *a, **kw: seen.append(kw["dense_min_rows"]) or built)
    for kind, available, asked, want in (("q8_0", 2**40, None, 16), ("q8_0", 1000, None, 0), ("q8_0", 1000, 8, 8),
                                         ("q8_0", None, None, 16),
                                         ("q4_k", 1000, None, 8), ("q4_k", 1000, 16, 16)):  # tiles take no memory
        monkeypatch.setattr("worker.model.gguf_loader.gguf_tensor_formats", lambda path: dict.fromkeys(names, kind))
        monkeypatch.setattr(host_memory, "available_bytes", lambda: available)
        model_runner.load_model_runner("model.gguf", dense_min_rows=asked)
        assert seen.pop() == want, (kind, available, asked)


def test_copied_bytes_counts_only_the_weights_in_q4_1_or_q8_0_blocks():
    """K-quant weights get no copy (their bfloat16 tiles are made per product), so a Q4_K_M
    file's copies weigh nothing and a file mixing formats counts only its Q4_1/Q8_0 projections."""
    from worker.model.dense_weights import dense_copy_bytes
    from worker.model.gguf_formats import copied_bytes
    from worker.model.model_config import ModelConfig

    config = ModelConfig(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                         intermediate_size=128, vocab_size=256)
    layer = {f"model.layers.{i}.mlp.{p}_proj.weight": "q8_0" for i in range(2) for p in ("gate", "up", "down")}
    kquants = {name: "q4_k" for name in layer} | {"model.embed_tokens.weight": "q6_k"}
    assert copied_bytes(config, kquants) == 0
    assert copied_bytes(config, layer) == 2 * 2 * 3 * 64 * 128  # gate, up and down of both layers
    assert copied_bytes(config, layer | {"model.embed_tokens.weight": "q8_0"}) == 2 * (2 * 3 * 64 * 128 + 256 * 64)
    assert dense_copy_bytes(config) > copied_bytes(config, layer)  # the upper bound: every projection


def test_dense_copies_need_gguf_blocks_with_bfloat16_activations():
    from worker.model.dense_weights import check_dense_min_rows

    check_dense_min_rows(0, "none", False)  # off: nothing to check
    with mock.patch("inflight_kernels.cpu_bf16_gemm", return_value=True), \
            mock.patch("inflight_kernels.cpu_kquant_tiles", return_value="bfloat16"):
        check_dense_min_rows(16, "gguf", True)
        for quantization, bf16 in (("none", False), ("q8_0", False), ("gguf", False)):
            with pytest.raises(ValueError, match="needs --quantization gguf"):
                check_dense_min_rows(16, quantization, bf16)
        with pytest.raises(ValueError, match="must be 0"):
            check_dense_min_rows(-1, "gguf", True)
    with mock.patch("inflight_kernels.cpu_bf16_gemm", return_value=False), \
            mock.patch("inflight_kernels.cpu_kquant_tiles", return_value=None):
        with pytest.raises(ValueError, match="AVX-512 BF16"):
            check_dense_min_rows(16, "gguf", True)
    with mock.patch("inflight_kernels.cpu_bf16_gemm", return_value=False), \
            mock.patch("inflight_kernels.cpu_kquant_tiles", return_value="float32"):
        check_dense_min_rows(16, "gguf", False)  # the float32 K-quant tiles of AVX2 CPUs


