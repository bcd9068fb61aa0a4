"""The pooling engine (``--runner pooling``) against transformers' own hidden states.

Random-weight models built in transformers (Qwen3: the architecture of Qwen3-Embedding,
q/k norms; Llama), saved as safetensors and loaded into our runner. Prompts of different
lengths are embedded in one engine, batched, with a per-step token budget small enough that
the longer prompts are prefilled over several steps beside shorter ones; each pooled vector
(LAST and MEAN pooling) must point where transformers' ``last_hidden_state`` pooled the same
way points (cosine >= 0.9999, float32). Also: truncation to ``dimensions`` then
normalization, each engine refusing the other's requests, abort, and every block back.
"""

from __future__ import annotations

import json

import pytest
import torch

from worker.engine.engine import LLMEngine, NOT_A_POOLING_ENGINE
from worker.engine.engine_config import EngineConfig
from worker.engine.engine_types import AddStatus, EmbeddingOutput, EngineRequest, PoolingParams
from worker.engine.pooler import PoolerConfig, finish_embedding
from worker.engine.pooling_engine import NOT_A_GENERATING_ENGINE, PoolingEngine
from worker.model.model_runner import load_model_runner

transformers = pytest.importorskip("transformers")

SMALL = dict(vocab_size=256, bos_token_id=1, eos_token_id=2, pad_token_id=0)
QWEN3 = dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", attention_bias=False, head_dim=32,
             hidden_act="silu", hidden_size=64, intermediate_size=192, max_position_embeddings=4096,
             num_attention_heads=4, num_hidden_layers=2, num_key_value_heads=2, rms_norm_eps=1e-06,
             rope_theta=1000000, tie_word_embeddings=True, use_sliding_window=False)
LLAMA = dict(architectures=["LlamaForCausalLM"], model_type="llama", attention_bias=False, hidden_act="silu",
             hidden_size=64, intermediate_size=128, max_position_embeddings=4096, num_attention_heads=4,
             num_hidden_layers=2, num_key_value_heads=2, rms_norm_eps=1e-05, rope_theta=10000.0,
             tie_word_embeddings=False)
BLOCK = 8
#: Lengths chosen around the budget (16 tokens a step): one short, one of exactly a
#: block, one spanning three steps, one of one token.
PROMPTS = [[(7 * i + 3 * j) % 250 + 3 for j in range(n)] for i, n in enumerate([5, 8, 37, 1, 20])]


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/worker/conftest.py


@pytest.fixture(scope="module", params=["qwen3", "llama", "qwen3-base"])
def model(request, tmp_path_factory):
    """(folder of the saved model, the transformers model float32). ``qwen3-base``: the base
    model saved alone (``Qwen3Model``: no ``model.`` prefix, no head), as Qwen3-Embedding ships."""
    published = {**(LLAMA if request.param == "llama" else QWEN3), **SMALL}
    folder = tmp_path_factory.mktemp(request.param)
    (folder / "config.json").write_text(json.dumps(published))
    config = transformers.AutoConfig.from_pretrained(folder)
    torch.manual_seed(0)
    build = transformers.AutoModel if request.param == "qwen3-base" else transformers.AutoModelForCausalLM
    hf = build.from_config(config, attn_implementation="eager", dtype=torch.float32)
    with torch.no_grad():  # sharper than the default init, so positions and every token matter
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape))
            elif "embed" in name:
                p.copy_(torch.randn(p.shape))
            elif p.dim() == 2:
                p.copy_(torch.randn(p.shape) / p.shape[1] ** 0.5)
    hf.eval().save_pretrained(folder)
    (folder / "config.json").write_text(json.dumps(published))
    return folder, hf


def _hf_pooled(hf, prompt: list[int], pooling: str) -> torch.Tensor:
    """transformers' final-norm hidden states of ``prompt`` pooled: ``[hidden]`` float32."""
    base = hf.model if hasattr(hf, "lm_head") else hf
    with torch.no_grad():
        hidden = base(torch.tensor([prompt])).last_hidden_state[0].float()
    return hidden[-1] if pooling == "LAST" else hidden.mean(dim=0)


def _engine(folder, pooling: str, normalize: bool = True, num_blocks: int = 64) -> PoolingEngine:
    runner = load_model_runner(folder, dtype="float32", kv_cache_dtype="float32", block_size=BLOCK,
                               num_blocks=num_blocks)
    config = EngineConfig(block_size=BLOCK, num_blocks=num_blocks, max_num_batched_tokens=16, max_num_seqs=8)
    return PoolingEngine(runner, None, config, PoolerConfig(pooling, normalize))


def _run(engine: PoolingEngine, max_steps: int = 100) -> dict[str, object]:
    """Step until nothing is unfinished; the outputs by request id."""
    out: dict[str, object] = {}
    for _ in range(max_steps):
        if not engine.has_unfinished():
            return out
        for o in engine.step():
            out[o.request_id] = o
    raise AssertionError("the engine did not finish")


def _cos(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.nn.functional.cosine_similarity(a.float(), b.float(), dim=0))


@pytest.mark.parametrize("pooling", ["LAST", "MEAN"])
def test_batched_embeddings_match_transformers_hidden_states(model, pooling):
    folder, hf = model
    engine = _engine(folder, pooling, normalize=False)
    for i, prompt in enumerate(PROMPTS):
        assert engine.add_request(EngineRequest(f"r{i}", prompt, pooling=PoolingParams(normalize=False))).ok
    out = _run(engine)
    assert engine.stats().num_steps >= 4  # 71 tokens at 16 a step: batched and chunked
    for i, prompt in enumerate(PROMPTS):
        got = out[f"r{i}"]
        assert isinstance(got, EmbeddingOutput) and got.prompt_tokens == len(prompt)
        want = _hf_pooled(hf, prompt, pooling)
        values = torch.tensor(got.values)
        assert values.shape == want.shape
        assert _cos(values, want) >= 0.9999, (pooling, i)
        torch.testing.assert_close(values, want, rtol=1e-3, atol=1e-3)  # unnormalized: the same vector
    assert len(engine._free) == engine.num_blocks  # every block back


def test_dimensions_truncate_then_normalize(model):
    folder, hf = model
    engine = _engine(folder, "LAST")
    prompt = PROMPTS[2]
    engine.add_request(EngineRequest("full", prompt, pooling=PoolingParams()))
    engine.add_request(EngineRequest("cut", prompt, pooling=PoolingParams(dimensions=16)))
    out = _run(engine)
    want = _hf_pooled(hf, prompt, "LAST")
    full, cut = torch.tensor(out["full"].values), torch.tensor(out["cut"].values)
    assert full.shape == (64,) and cut.shape == (16,)
    assert abs(float(full.norm()) - 1.0) < 1e-5 and abs(float(cut.norm()) - 1.0) < 1e-5
    assert _cos(full, want) >= 0.9999
    assert _cos(cut, want[:16]) >= 0.9999  # truncated first, normalized after


def test_each_engine_refuses_the_others_requests(model):
    folder, _ = model
    pooling = _engine(folder, "LAST")
    refused = pooling.add_request(EngineRequest("gen", [5, 6, 7]))
    assert refused.status is AddStatus.INVALID and refused.reason == NOT_A_GENERATING_ENGINE
    too_wide = pooling.add_request(EngineRequest("wide", [5, 6], pooling=PoolingParams(dimensions=65)))
    assert too_wide.status is AddStatus.INVALID and "dimensions" in too_wide.reason
    assert not pooling.has_unfinished()
    runner = load_model_runner(folder, dtype="float32", block_size=BLOCK, num_blocks=16)
    generating = LLMEngine(runner, _NoTokenizer(), EngineConfig(block_size=BLOCK, num_blocks=16))
    refused = generating.add_request(EngineRequest("emb", [5, 6, 7], pooling=PoolingParams()))
    assert refused.status is AddStatus.INVALID and refused.reason == NOT_A_POOLING_ENGINE


def test_too_long_never_fits_and_abort_frees_blocks(model):
    folder, _ = model
    engine = _engine(folder, "MEAN", num_blocks=4)  # 32 tokens of KV
    never = engine.add_request(EngineRequest("long", list(range(3, 40)), pooling=PoolingParams()))
    assert never.status is AddStatus.NEVER_FITS
    assert engine.add_request(EngineRequest("a", list(range(3, 27)), pooling=PoolingParams())).ok
    full = engine.add_request(EngineRequest("b", list(range(3, 27)), pooling=PoolingParams()), only_if_room=True)
    assert full.status is AddStatus.NO_ROOM
    engine.step()  # "a" runs its first 16 tokens, holding its 3 blocks
    assert engine.abort("a")
    outputs = engine.step()
    assert [(o.request_id, o.finish_reason) for o in outputs] == [("a", "abort")]
    assert len(engine._free) == 4 and not engine.has_unfinished()


def test_finish_embedding_refuses_more_dimensions_than_the_vector():
    with pytest.raises(ValueError, match="dimensions 5"):
        finish_embedding(torch.ones(4), 5, True)


@pytest.mark.parametrize("text, error", [("[]", "object"), ('{"pooling_type": "max"}', "pooling_type"),
                                         ('{"softmax": true}', "softmax"), ('{"normalize": 1}', "normalize")])
def test_pooler_config_refuses_what_it_cannot_do(text, error):
    with pytest.raises(ValueError, match=error):
        PoolerConfig.from_json(text)


def test_pooler_config_reads_vllms_json():
    assert PoolerConfig.from_json("") == PoolerConfig("LAST", True)
    assert PoolerConfig.from_json('{"pooling_type": "mean", "normalize": false}') == PoolerConfig("MEAN", False)


class _NoTokenizer:
    eos_token_ids = (2,)

    def decode(self, ids, skip_special_tokens=True):
        return ""
