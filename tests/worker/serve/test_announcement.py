"""What a worker announces in its heartbeat (worker/serve/main.py ``announcement``, the JSON of
common/served_model.py): its served names (model id first), context length, tokenizer
fingerprint, task from ``--runner``, and the LoRA adapters loaded at each beat."""

from __future__ import annotations

import dataclasses
import json
from types import SimpleNamespace

from common.served_model import DEFAULT_SERVED_NAME, Announcement, default_served_name
from common.tokenizer_fingerprint import tokenizer_fingerprint
from tests.gateway.fake_tokenizer import CharTokenizer
from tests.worker.fakes import fake_tokenizer
from worker.serve.main import announcement
from worker.serve.settings import WorkerSettings


def test_the_heartbeat_says_names_context_fingerprint_task_and_the_adapters_loaded_now():
    loaded = ["sql"]
    engine = SimpleNamespace(max_model_len=2048, tokenizer=fake_tokenizer(), lora_names=lambda: list(loaded))
    settings = WorkerSettings(worker_id="w7", served_model_name=("qwen", "qwen-latest"), health_port=0)
    beat = json.loads(announcement(settings, engine, 1700000000.0, "abc").to_json())
    assert beat["model"] == "qwen" and beat["served_model_names"] == ["qwen", "qwen-latest"]
    assert (beat["max_model_len"], beat["tokenizer_fingerprint"], beat["task"]) == (2048, "abc", "generate")
    assert beat["adapters"] == ["sql"] and beat["started"] == 1700000000.0
    loaded.append("chat")  # loaded at run time: the next beat says so
    again = Announcement.parse("w7", announcement(settings, engine, 1700000000.0, "abc").to_json())
    assert again.adapters == ("sql", "chat") and again.model == "qwen"
    assert announcement(dataclasses.replace(settings, runner="pooling"), engine, 0.0, "abc").task == "embed"
    no_lora = SimpleNamespace(max_model_len=8, tokenizer=fake_tokenizer())
    assert announcement(settings, no_lora, 0.0, "abc").adapters == ()


def test_default_names_and_an_older_heartbeat():
    assert WorkerSettings().model_id == DEFAULT_SERVED_NAME == default_served_name("smollm2")
    assert default_served_name("/m/Qwen2.5-0.5B-Instruct-Q4_K_M.gguf") == "Qwen2.5-0.5B-Instruct-Q4_K_M"
    assert default_served_name("/m/Qwen2.5-0.5B-Instruct/") == "Qwen2.5-0.5B-Instruct"
    old = Announcement.parse("w1", json.dumps({"model": "m", "batching": "continuous"}))
    assert (old.served_model_names, old.tokenizer_fingerprint, old.task) == (("m",), "", "generate")
    assert Announcement.parse("w1", "not json") is None and Announcement.parse("w1", "[1]") is None


def test_the_fingerprint_tells_tokenizers_apart_and_not_two_loads_of_one():
    assert tokenizer_fingerprint(CharTokenizer(300)) == tokenizer_fingerprint(CharTokenizer(300))
    assert tokenizer_fingerprint(CharTokenizer(300)) != tokenizer_fingerprint(CharTokenizer(200))
    from common.model_files import resolve_model_path
    from common.tokenizer import load_tokenizer

    path = resolve_model_path(None)
    a, b = load_tokenizer(path), load_tokenizer(path)
    assert tokenizer_fingerprint(a) == tokenizer_fingerprint(b) and len(tokenizer_fingerprint(a)) == 16
    b.eos_token_ids = frozenset({*b.eos_token_ids, 5})  # another end-of-generation id: another tokenizer
    assert tokenizer_fingerprint(a) != tokenizer_fingerprint(b)
