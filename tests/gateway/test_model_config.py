"""Which models a gateway serves (gateway/model_config.py): ``--model NAME=PATH`` repeated or
``PATH`` alone, a models file (JSON; YAML with PyYAML), ``INFLIGHT_GATEWAY_MODELS``, and
today's single model when none is given; malformed entries refused in one line."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from common.served_model import DEFAULT_SERVED_NAME
from gateway.model_config import ModelSpec, model_specs, parse_model_arg
from gateway.settings import GatewaySettings


def test_model_flags_files_and_the_default(tmp_path):
    assert GatewaySettings().model_specs() == [ModelSpec(DEFAULT_SERVED_NAME, None)]
    assert GatewaySettings(served_model_name="m", model_path="/x.gguf").model_specs() == [ModelSpec("m", "/x.gguf")]
    assert parse_model_arg("qwen=/models/Qwen2.5-0.5B") == ModelSpec("qwen", "/models/Qwen2.5-0.5B")
    assert parse_model_arg("/models/tiny.Q8_0.gguf") == ModelSpec("tiny.Q8_0", "/models/tiny.Q8_0.gguf")
    assert parse_model_arg("smollm2") == ModelSpec(DEFAULT_SERVED_NAME, "smollm2")
    listed = tmp_path / "models.json"
    listed.write_text(json.dumps({"models": [{"name": "e5", "path": "/models/e5", "task": "embed"}]}))
    specs = GatewaySettings(models=("a=/a", "b=/b"), models_file=str(listed)).model_specs()
    assert [s.name for s in specs] == ["a", "b", "e5"] and specs[2].task == "embed"  # the first is the default
    env = GatewaySettings.from_env({"INFLIGHT_GATEWAY_MODELS": "a=/a, b=/b"})
    assert env.models == ("a=/a", "b=/b")
    yaml_file = tmp_path / "models.yaml"
    yaml_file.write_text("- name: y\n  path: /y\n")
    default = tmp_path / "default.json"  # the default model's name may omit the path: its files
    default.write_text(json.dumps([{"name": DEFAULT_SERVED_NAME}]))
    assert model_specs((), str(default), "unused", None) == [ModelSpec(DEFAULT_SERVED_NAME, None)]
    pytest.importorskip("yaml")
    assert model_specs((), str(yaml_file), "unused", None) == [ModelSpec("y", "/y")]


@pytest.mark.parametrize("models, text, message", [
    (("a=/a", "a=/b"), None, "configured twice"),
    (("=/a",), None, "expected NAME=PATH"),
    ((), '[{"path": "/a"}]', "needs a 'name'"),
    ((), '[{"name": "a", "task": "rerank"}]', "task must be one of generate, embed"),
    ((), "[]", "non-empty list"),
    ((), '[{"name": "smol-b"}]', "model 'smol-b' needs a 'path'"),  # was SmolLM2's tokenizer, silently
    ((), '[{"name": "smol-b", "path": ""}]', "'path' must be a non-empty string"),
    ((), '[{"name": "smol-b", "path": 3}]', "'path' must be a non-empty string"),
])
def test_malformed_models_are_refused(tmp_path, models, text, message):
    path = ""
    if text is not None:
        (tmp_path / "m.json").write_text(text)
        path = str(tmp_path / "m.json")
    with pytest.raises(ValueError, match=message):
        GatewaySettings(models=models, models_file=path).model_specs()


def test_the_gateway_command_refuses_a_model_it_cannot_load_in_one_line(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "inflight.cli", "gateway", "--model", f"x={tmp_path / 'missing'}"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "does not exist" in proc.stderr and proc.stderr.count("\n") == 1
