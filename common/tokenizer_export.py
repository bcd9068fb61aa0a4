"""Write the served model's tokenizer as a transformers-style folder (no torch).

``inflight tokenizer export DIR`` calls :func:`export_tokenizer`: benchmark clients
that count tokens with ``transformers.AutoTokenizer`` (aiperf, guidellm, ``vllm bench
serve``) can then run offline against inflight, with the very tokenizer and chat
template :mod:`common.tokenizer` serves (from a GGUF file or an HF folder):

* ``tokenizer.json``: the ``tokenizers`` pipeline, with a BOS post-processor when the
  model adds BOS (``add_special_tokens=True`` then gives the ids of
  ``Tokenizer.encode(text, add_special_tokens=True)``);
* ``tokenizer_config.json``: ``PreTrainedTokenizerFast``, the chat template, the
  special tokens, ``model_max_length`` = the context length;
* ``special_tokens_map.json``;
* ``config.json`` (a GGUF's architecture, context length, vocabulary size, BOS/EOS ids;
  an HF folder's own file is copied) and ``generation_config.json`` (every
  end-of-generation id), so ``common.tokenizer.load_tokenizer(DIR)`` gives back the
  same tokenizer, EOS set included.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import processors

from common.tokenizer import Tokenizer, load_tokenizer


def export_tokenizer(model_path: str | Path, out_dir: str | Path) -> list[Path]:
    """Export the tokenizer of ``model_path`` (a GGUF file or an HF folder) into
    ``out_dir`` (created if missing; files there of the same names are replaced).

    Returns:
        The files written.
    """
    model_path, out = Path(model_path), Path(out_dir)
    tok = load_tokenizer(model_path)
    out.mkdir(parents=True, exist_ok=True)
    specials = tok._specials  # noqa: SLF001 - same package: the loader's parsed special tokens
    hf = HFTokenizer.from_str(tok.hf.to_str())
    if specials.add_bos_token and specials.bos_token:
        hf.post_processor = processors.TemplateProcessing(
            single=f"{specials.bos_token}:0 $A:0", pair=f"{specials.bos_token}:0 $A:0 $B:1",
            special_tokens=[(specials.bos_token, specials.bos_token_id)])
    written = [out / "tokenizer.json"]
    hf.save(str(written[0]))

    added = hf.get_added_tokens_decoder()
    named = {"bos_token": specials.bos_token, "eos_token": specials.eos_token}
    extra = [t.content for _, t in sorted(added.items()) if t.special and t.content not in named.values()]
    special_map: dict[str, Any] = {k: v for k, v in named.items() if v}
    if extra:
        special_map["additional_special_tokens"] = extra
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": tok.context_length,
        "clean_up_tokenization_spaces": False,
        "add_bos_token": specials.add_bos_token,
        "add_eos_token": False,
        "added_tokens_decoder": {str(i): {"content": t.content, "lstrip": t.lstrip, "normalized": t.normalized,
                                          "rstrip": t.rstrip, "single_word": t.single_word, "special": t.special}
                                 for i, t in sorted(added.items())},
        **special_map,
    }
    template = tok._chat_template_source  # noqa: SLF001 - same package
    if template:
        config["chat_template"] = template
    written += [_write_json(out / "tokenizer_config.json", config),
                _write_json(out / "special_tokens_map.json", special_map)]
    if model_path.is_dir() and (model_path / "config.json").is_file():
        if (model_path / "config.json").resolve() != (out / "config.json").resolve():
            shutil.copyfile(model_path / "config.json", out / "config.json")
        written.append(out / "config.json")
    else:
        written.append(_write_json(out / "config.json", _gguf_config(model_path, tok)))
    eos = sorted(tok.eos_token_ids)
    written.append(_write_json(out / "generation_config.json", {
        "bos_token_id": tok.bos_token_id, "eos_token_id": eos[0] if len(eos) == 1 else eos}))
    return written


def _gguf_config(model_path: Path, tok: Tokenizer) -> dict[str, Any]:
    """A small ``config.json`` for a GGUF model: what token-counting clients read."""
    from common.tokenizer_files import gguf_fields

    meta = gguf_fields(model_path) if model_path.is_file() else {}
    arch = str(meta.get("general.architecture", "llama"))
    eos = sorted(tok.eos_token_ids)
    return {"model_type": arch, "architectures": [f"{arch.capitalize()}ForCausalLM"],
            "max_position_embeddings": tok.context_length, "vocab_size": tok.vocab_size,
            "bos_token_id": tok.bos_token_id, "eos_token_id": eos[0] if len(eos) == 1 else eos,
            "_name_or_path": tok.model_name}


def _write_json(path: Path, value: Any) -> Path:
    path.write_text(json.dumps(value, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    return path
