"""Oracle: a LoRA adapter's greedy tokens through our engine equal transformers + peft with the
adapter merged into the weights (float32, a random-weight small Llama and random adapters
saved by peft in its own format), alone and in one continuous batch with base rows and
another adapter's rows; and the prefix cache never shares blocks between adapters."""

from __future__ import annotations

import json

import pytest
import torch

from tests.worker.engine_helpers import assert_no_leaks, collect, drain
from tests.worker.fakes import fake_tokenizer
from worker.engine.engine import EngineRequest, LLMEngine
from worker.engine.engine_config import EngineConfig
from worker.engine.sampling_params import SamplingParams
from worker.model.model_runner import load_model_runner

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

NEW_TOKENS = 12
SMALL = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=64, intermediate_size=128,
             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
             rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False, torch_dtype="float32")
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
#: (name, peft LoraConfig arguments): every projection; a subset with rsLoRA and another rank
ADAPTERS = {"all-r8": dict(r=8, lora_alpha=16, target_modules=ALL),
            "qv-down-r4-rs": dict(r=4, lora_alpha=8, use_rslora=True, target_modules=["q_proj", "v_proj", "down_proj"])}
PROMPTS = ["Hello, my name is", "continuous batching keeps the accelerator busy", "Emoji: rocket fire grin"]


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/worker/conftest.py


def _randomize(model, seed: int) -> None:
    """Sharp attention, O(1) activations (as tests/worker/model/test_arch_oracle.py); for the
    adapters (``lora_`` parameters) A and B alike N(0, 1 / fan_in), so the adapter changes the text."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if "norm" in name:
                p.copy_(noise * 0.1 + 1.0)
            elif "embed" in name:
                p.copy_(noise)
            else:
                gain = 2.0 if any(k in name for k in ("q_proj.weight", "k_proj.weight")) else 1.0
                p.copy_(noise * gain / p.shape[1] ** 0.5)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """(base folder, {adapter name: folder}) written by transformers and peft."""
    root = tmp_path_factory.mktemp("lora")
    base_dir = root / "base"
    config = transformers.LlamaConfig(**{k: v for k, v in SMALL.items() if k not in ("architectures", "model_type")},
                                      vocab_size=fake_tokenizer().vocab_size)
    model = transformers.LlamaForCausalLM(config).eval()
    _randomize(model, 0)
    model.save_pretrained(base_dir)
    adapters = {}
    for seed, (name, kwargs) in enumerate(ADAPTERS.items(), start=1):
        fresh = transformers.LlamaForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
        peft_model = peft.get_peft_model(fresh, peft.LoraConfig(init_lora_weights=False, **kwargs))
        with torch.no_grad():
            gen = torch.Generator().manual_seed(seed)
            for pname, p in peft_model.named_parameters():
                if "lora_" in pname:
                    p.copy_(torch.randn(p.shape, generator=gen) / p.shape[1] ** 0.5)
        peft_model.save_pretrained(root / name)
        adapters[name] = root / name
    return base_dir, adapters


def _prompts() -> list[list[int]]:
    return [fake_tokenizer().encode(p) for p in PROMPTS]


@pytest.fixture(scope="module")
def oracle(model_dir) -> dict[tuple[str, int], list[int]]:
    """transformers' greedy tokens per (adapter or "" for base, prompt index), the adapter merged."""
    base_dir, adapters = model_dir
    out = {}
    for name in ["", *adapters]:
        model = transformers.LlamaForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
        if name:
            model = peft.PeftModel.from_pretrained(model, adapters[name]).merge_and_unload()
        model.eval()
        with torch.no_grad():
            for i, ids in enumerate(_prompts()):
                generated = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                           max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)
                out[(name, i)] = generated[0, len(ids):].tolist()
    return out


def _engine(model_dir, max_loras: int = 2, **config) -> LLMEngine:
    base_dir, adapters = model_dir
    runner = load_model_runner(base_dir, dtype="float32", kv_cache_dtype="float32", num_blocks=64)
    engine = LLMEngine(runner, fake_tokenizer(), EngineConfig(block_size=runner.block_size, enable_lora=True,
                                                              max_loras=max_loras, **config))
    for name, path in adapters.items():
        engine.add_lora(name, str(path))
    return engine


def _request(rid: str, prompt: int, lora: str = "") -> EngineRequest:
    return EngineRequest(rid, _prompts()[prompt], SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0,
                                                                 ignore_eos=True), lora_name=lora)


def test_the_adapters_change_the_text(oracle):
    """Not vacuous: each adapter's merged model answers otherwise than the base model."""
    for name in ADAPTERS:
        assert any(oracle[(name, i)] != oracle[("", i)] for i in range(len(PROMPTS))), name


@pytest.mark.parametrize("path", ["fused", "torch"])
def test_one_adapter_alone_matches_peft_merged(model_dir, oracle, path, monkeypatch):
    """Through the fused CPU layer path (Llama's blocks) and the torch path the other
    architectures take."""
    if path == "torch":
        from worker.model.llama import LlamaDecoder

        monkeypatch.setattr(LlamaDecoder, "_fused_ops", lambda self: None)
    engine = _engine(model_dir)
    for i in range(len(PROMPTS)):
        assert engine.add_request(_request(f"a{i}", i, "all-r8")).ok
    results = drain(engine)
    assert_no_leaks(engine)
    for i in range(len(PROMPTS)):
        assert results[f"a{i}"].token_ids == oracle[("all-r8", i)], i


def test_base_rows_and_two_adapters_in_one_continuous_batch(model_dir, oracle):
    """Every prompt with the base model and with each adapter, all in the same steps (prefills
    mixed with decodes: requests join one step apart); each equals its own oracle."""
    engine = _engine(model_dir)
    names = ["", *ADAPTERS]
    pending = [(f"{name or 'base'}-{i}", i, name) for i in range(len(PROMPTS)) for name in names]
    results: dict = {}
    step = 0
    mixed = 0
    while pending or engine.has_unfinished():
        if pending:
            rid, i, name = pending.pop(0)
            assert engine.add_request(_request(rid, i, name)).ok
        collect(engine.step(), results, step)
        ids = {c.lora_id for c in engine.last_schedule.model_input.chunks} if engine.last_schedule else set()
        mixed = max(mixed, len(ids))
        step += 1
    assert mixed == 3, "base rows and both adapters never shared a step"
    assert_no_leaks(engine)
    for i in range(len(PROMPTS)):
        for name in names:
            assert results[f"{name or 'base'}-{i}"].token_ids == oracle[(name, i)], (name, i)


def test_prefix_cache_is_not_shared_between_adapters(model_dir, oracle):
    """The same long prompt with the base model, then adapter A, then adapter B: no request
    gets a cached block computed with another adapter, and each answers its oracle."""
    engine = _engine(model_dir)
    prompt = _prompts()[1] * 3  # several full blocks
    cached = {}
    for name in ["", *ADAPTERS, ""]:
        rid = f"{name or 'base'}-{len(cached)}"
        engine.add_request(EngineRequest(rid, prompt, SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True),
                                         lora_name=name))
        drain(engine)
        cached[rid] = engine.scheduler.prefix_hits
    hits = list(cached.values())
    assert hits[0] == hits[1] == hits[2] == 0  # base, then each adapter: nothing shared
    assert hits[3] > 0  # the base prompt again: its own blocks are reused
    # a router hashing the prompt with the adapter's salt finds the adapter's own blocks
    from common.block_hash import adapter_salt, prompt_block_hashes

    salts = engine.lora_salts()
    assert set(salts) == set(ADAPTERS) and salts["all-r8"].startswith("all-r8@")
    held = set(engine.cached_block_hashes())
    for name in ADAPTERS:
        hashes = prompt_block_hashes(prompt, engine.block_manager.block_size,
                                     adapter_salt(engine.block_hash_salt, salts[name]))
        assert hashes and set(hashes) <= held, name
    assert not set(prompt_block_hashes(prompt, engine.block_manager.block_size,
                                       adapter_salt(engine.block_hash_salt, "all-r8"))) & held  # the name alone: no
    assert_no_leaks(engine)


def test_unknown_adapter_is_refused_and_the_batch_goes_on(model_dir, oracle):
    engine = _engine(model_dir)
    assert engine.add_request(_request("ok", 0, "all-r8")).ok
    results: dict = {}
    collect(engine.step(), results, 0)
    refused = engine.add_request(_request("bad", 0, "nope"))
    assert not refused.ok and "unknown LoRA adapter 'nope'" in refused.reason
    drain(engine, results, step0=1)
    assert results["ok"].token_ids == oracle[("all-r8", 0)]
    assert_no_leaks(engine)


def test_lru_eviction_past_max_loras_and_reload(model_dir, oracle):
    """With --max-loras 1 both adapters stay servable: a request for the unloaded one reloads it,
    evicting the other (not held); while one is held, the other's request waits (NO_ROOM)."""
    engine = _engine(model_dir, max_loras=1)
    assert engine.lora_names() == list(ADAPTERS)
    assert engine.loras.loaded_names() == ["qv-down-r4-rs"]  # the last added; the first evicted
    assert engine.add_request(_request("first", 0, "all-r8")).ok  # reloaded, the other evicted
    assert engine.loras.loaded_names() == ["all-r8"]
    waits = engine.add_request(_request("second", 0, "qv-down-r4-rs"))
    assert waits.status.name == "NO_ROOM" and "--max-loras" in waits.reason
    results = drain(engine)
    assert results["first"].token_ids == oracle[("all-r8", 0)]
    assert engine.add_request(_request("second", 0, "qv-down-r4-rs")).ok
    results = drain(engine)
    assert results["second"].token_ids == oracle[("qv-down-r4-rs", 0)]
    assert len(engine.runner.loras) == 1
    assert_no_leaks(engine)


def test_an_evicted_adapter_whose_files_are_gone_is_refused_without_the_path(model_dir, tmp_path):
    """A request for an evicted adapter whose folder was deleted meanwhile is refused (INVALID)
    with a reason that names the adapter but not the server's path (the client may not see it)."""
    import shutil

    engine = _engine(model_dir, max_loras=1)
    copy = shutil.copytree(model_dir[1]["all-r8"], tmp_path / "ephemeral")
    engine.add_lora("ephemeral", str(copy))
    assert engine.add_request(_request("other", 0, "all-r8")).ok  # evicts "ephemeral"
    drain(engine)
    shutil.rmtree(copy)
    refused = engine.add_request(_request("gone", 0, "ephemeral"))
    assert refused.status.name == "INVALID" and "'ephemeral'" in refused.reason
    assert str(tmp_path) not in refused.reason and "adapter_config" not in refused.reason
    assert_no_leaks(engine)


def test_remove_lora_while_running(model_dir, oracle):
    """Unloading an adapter refuses new requests for it at once; a running one finishes with it."""
    engine = _engine(model_dir)
    assert engine.add_request(_request("running", 0, "all-r8")).ok
    results: dict = {}
    collect(engine.step(), results, 0)
    assert engine.remove_lora("all-r8")
    assert "all-r8" not in engine.lora_names()
    assert not engine.add_request(_request("late", 0, "all-r8")).ok
    assert len(engine.runner.loras) == 2  # still held by "running"
    drain(engine, results, step0=1)
    assert results["running"].token_ids == oracle[("all-r8", 0)]
    assert len(engine.runner.loras) == 1  # its weights went with its last request
    assert_no_leaks(engine)


def _write_adapter(folder, config: dict, tensors: dict) -> str:
    from safetensors.torch import save_file

    folder.mkdir()
    (folder / "adapter_config.json").write_text(json.dumps(config))
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    return str(folder)


def test_refusals_name_why(model_dir, tmp_path):
    engine = _engine(model_dir)
    good = model_dir[1]["all-r8"]
    config = json.loads((good / "adapter_config.json").read_text())
    from safetensors.torch import load_file

    tensors = load_file(str(good / "adapter_model.safetensors"))
    cases = {
        "rank": ({**config, "r": 32}, tensors, "rank 32 exceeds --max-lora-rank 16"),
        "module": ({**config, "target_modules": ["q_proj", "c_attn"]}, tensors, "['c_attn']"),
        "lm_head": (config, {**tensors, "base_model.model.lm_head.lora_A.weight": torch.zeros(8, 64)},
                    "has no LoRA for"),
        "shape": (config, {k: (torch.zeros(v.shape[0], 96) if k.endswith("q_proj.lora_A.weight") else v)
                           for k, v in tensors.items()}, "base model mismatch"),
        "layers": (config, {**tensors, "base_model.model.model.layers.7.self_attn.q_proj.lora_A.weight": torch.zeros(8, 64),
                            "base_model.model.model.layers.7.self_attn.q_proj.lora_B.weight": torch.zeros(64, 8)},
                   "for layer 7, the model has 2 layers: base model mismatch"),
        "dora": ({**config, "use_dora": True}, tensors, "DoRA is not supported"),
        "nan": (config, {k: torch.full_like(v, float("nan")) for k, v in tensors.items()}, "NaN or infinite"),
        "inf": (config, {k: (torch.full_like(v, float("inf")) if "lora_B" in k else v) for k, v in tensors.items()},
                "NaN or infinite"),
        "alpha_huge_int": ({**config, "lora_alpha": 10 ** 400}, tensors, "lora_alpha must be a finite number"),
        "alpha_bool": ({**config, "lora_alpha": True}, tensors, "lora_alpha must be a finite number"),
        "alpha_overflows_b": ({**config, "lora_alpha": 1e300}, tensors, "beyond the range of float32"),
    }
    for name, (cfg, weights, why) in cases.items():
        path = _write_adapter(tmp_path / name, cfg, weights)
        with pytest.raises(ValueError, match=None) as info:
            engine.add_lora(name, path)
        assert why in str(info.value), (name, str(info.value))
        assert name not in engine.lora_names()
    with pytest.raises(FileNotFoundError, match="adapter_config.json"):
        engine.add_lora("missing", str(tmp_path / "nowhere"))
    assert engine.lora_names() == list(ADAPTERS)


def test_lora_off_refuses_adapters(model_dir):
    base_dir, adapters = model_dir
    runner = load_model_runner(base_dir, dtype="float32", kv_cache_dtype="float32", num_blocks=16)
    engine = LLMEngine(runner, fake_tokenizer(), EngineConfig(block_size=runner.block_size))
    assert engine.lora_names() == []
    with pytest.raises(ValueError, match="--enable-lora"):
        engine.add_lora("x", str(adapters["all-r8"]))
    refused = engine.add_request(_request("r", 0, "all-r8"))
    assert not refused.ok and "--enable-lora" in refused.reason
