"""Is a LoRA adapter's base model this worker's model? The comparison of ``adapter_config.json``'s
``base_model_name_or_path`` with what the worker knows of its model, refusing only a clear
mismatch (issue 44, item 7).

An adapter trained on another model of the same shapes (Llama-3.2-1B's adapter on a 1B
finetune of another family, Mistral v0.1's on v0.3) loads without complaint from the tensor
checks (:mod:`worker.model.lora`) and answers with garbage. vLLM loads it anyway; we refuse it
when both sides are known and clearly differ, and never otherwise:

* **The adapter's side** is ``base_model_name_or_path`` when it is a Hub id (``org/name``) or a
  bare name; a Hugging Face cache path (``.../models--org--name/snapshots/<hash>``) counts as
  ``org/name``. No base, or another local path (``/data/ckpt/step-500``: its last folder says
  nothing reliable), is not compared: the adapter loads and the worker logs why.
* **The model's side** (:class:`ModelIdentity`) has two kinds of names. ``names`` are what the
  model's files say of themselves: a GGUF's ``general.name``, ``general.basename`` (with
  ``general.size_label``), ``general.base_model.N.name``/``repo_url`` and its source/repo URLs;
  an HF folder's ``config.json`` ``_name_or_path`` when it is a Hub id. ``labels`` are names an
  operator chose: the served model names and aliases, the GGUF file's or the folder's name (the
  Hub repo of an HF cache path). Both confirm a match; only ``names`` make the model *known*, so
  a worker whose files name nothing (``--served-model-name prod`` on a GGUF without metadata)
  never refuses.
* **Normalised** (:func:`name_tokens`): lower case, the ``org/`` prefix and any folders dropped,
  ``.gguf`` dropped, quantization and format tags dropped (``Q4_K_M``, ``Q4_1``, ``f16``,
  ``bnb-4bit``, ``awq``, ``gptq`` ...), split into words at punctuation and where letters meet
  digits (``Llama3`` = ``Llama-3``; ``v0.3`` = ``0.3``), and the variant words ``instruct``,
  ``chat``, ``it``, ``base``, ``hf`` dropped with a few generic ones (``model``, ``merged``):
  an adapter trained on ``Llama-3.1-8B`` fits ``Llama-3.1-8B-Instruct`` (same shapes, same
  pretraining; adapters are moved between the two routinely), so that pair matches.
* **Matches** when the adapter's words are a subset of one of the model's names' words, or one
  name's words a subset of the adapter's (``SmolLM2-135M-Instruct`` matches the GGUF's
  ``Smollm2 135M 8k Lc100K Mix1 Ep2`` and ``smollm2``). Refused when the model is known and no
  name or label matches: ``Llama-3.2-1B`` against ``SmolLM2 135M``, ``Mistral 7B v0.1`` against
  ``Mistral 7B v0.3``.

No flag overrides it (vLLM has none to copy): an adapter that truly fits a model its config
does not name is loaded after setting its ``base_model_name_or_path`` to the model's name, or
removing it, as the refusal says.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

#: Words that name a variant or nothing at all, dropped before comparing (module docstring).
IGNORED_WORDS = frozenset({"instruct", "chat", "it", "base", "hf", "v", "model", "merged", "checkpoint",
                           "final", "pretrained", "original"})
_FORMAT_TAG = re.compile(r"(?<![a-z0-9])(?:i?q\d+(?:_[a-z0-9]+)*|bf16|fp16|f16|fp32|f32|gguf|ggml|awq|gptq|"
                         r"exl2|mlx|bnb|int4|int8|\d+bits?)(?![a-z0-9])")
_WORD = re.compile(r"\d+(?:\.\d+)*[a-z]*|[a-z]+")
_HF_CACHE = re.compile(r"(?:^|/)models--([^/]+?)--([^/]+)(?:/|$)")
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(?:/[\w.-]+)?")
_SUFFIXES = (".gguf", ".safetensors", ".bin")


@dataclass(frozen=True)
class ModelIdentity:
    """What a worker knows of its model's name (module docstring).

    Attributes:
        names: what the model's files say of themselves (GGUF ``general.*`` names, an HF
            config's Hub-id ``_name_or_path``): they make the model known.
        labels: names an operator chose (served names and aliases, the file's or folder's name):
            they only confirm a match.
    """

    names: tuple[str, ...] = ()
    labels: tuple[str, ...] = ()

    @property
    def known(self) -> bool:
        """True when one of :attr:`names` has a word left after normalising."""
        return any(name_tokens(name) for name in self.names)

    def describe(self) -> str:
        """The names, for messages (``'a', 'b'``), at most four, names first."""
        shown = list(dict.fromkeys((*self.names, *self.labels)))[:4]
        return ", ".join(repr(n) for n in shown) or "unnamed"


def name_tokens(name: str) -> frozenset[str]:
    """The words of a model name that identify it (module docstring): ``"meta-llama/Llama-3.2-1B-Instruct"``
    → ``{"llama", "3.2", "1b"}``; empty for a name of variant words only (``"hf"``)."""
    text = str(name).strip().lower().replace("\\", "/").rstrip("/")
    text = text.rsplit("/", 1)[-1]
    for suffix in _SUFFIXES:
        if text.endswith(suffix):
            text = text[:-len(suffix)]
    text = _FORMAT_TAG.sub(" ", text)
    return frozenset(word for word in _WORD.findall(text) if word not in IGNORED_WORDS)


def _matches(a: frozenset[str], b: frozenset[str]) -> bool:
    return bool(a) and bool(b) and (a <= b or b <= a)


def adapter_base(value: object) -> tuple[str | None, str]:
    """``(the name to compare or None, why not)`` of an adapter's ``base_model_name_or_path``:
    a Hub id or bare name as it is, a Hugging Face cache path as its ``org/name``, anything
    else (no value, a local path) None with the reason for the log."""
    if not isinstance(value, str) or not value.strip():
        return None, "names no base model (base_model_name_or_path)"
    text = value.strip()
    cached = _HF_CACHE.search(text.replace("\\", "/"))
    if cached:
        return f"{cached[1]}/{cached[2]}", ""
    if _HUB_ID.fullmatch(text) and not text.startswith("."):
        return text, ""
    return None, f"names a local path as its base model ({text[:200]!r}), which says nothing reliable of it"


def _hub_name(url: str) -> str:
    """``org/name`` of a Hub URL (``https://huggingface.co/org/name``), else the text."""
    parts = [p for p in str(url).split("?")[0].rstrip("/").split("/") if p]
    return "/".join(parts[-2:]) if "://" in str(url) and len(parts) >= 2 else str(url)


def _gguf_names(path: Path) -> list[str]:
    """The names a GGUF file's ``general.*`` metadata gives its model."""
    from common.gguf_file import gguf_reader

    fields = gguf_reader(path).fields

    def text(key: str) -> str:
        field = fields.get(key)
        value = field.contents() if field is not None else None
        return value.strip() if isinstance(value, str) else ""

    names = [text("general.name")]
    if basename := text("general.basename"):
        names.append(f"{basename} {text('general.size_label')}".strip())
    count = fields.get("general.base_model.count")
    for i in range(int(count.contents()) if count is not None else 0):
        names.append(text(f"general.base_model.{i}.name"))
        names.append(_hub_name(text(f"general.base_model.{i}.repo_url")))
    for key in ("general.repo_url", "general.source.repo_url", "general.source.huggingface.repository"):
        names.append(_hub_name(text(key)))
    return [n for n in names if n]


def model_identity(path: str | Path | None, served_names: tuple[str, ...] | list[str] = ()) -> ModelIdentity:
    """What the worker knows of the model at ``path`` (a GGUF file or an HF folder, as
    :func:`common.model_files.resolve_model_path` gives it) served as ``served_names``.
    Never raises: an unreadable model (refused by its own check) gives labels only."""
    labels = [str(n) for n in served_names if n]
    names: list[str] = []
    if path is None:
        return ModelIdentity((), tuple(labels))
    path = Path(path)
    cached = _HF_CACHE.search(str(path).replace("\\", "/"))
    labels.append(f"{cached[1]}/{cached[2]}" if cached else path.name)
    try:
        if path.is_file():
            names = _gguf_names(path)
        elif (path / "config.json").is_file():
            raw = json.loads((path / "config.json").read_text()).get("_name_or_path")
            if isinstance(raw, str) and raw.strip():
                base, _ = adapter_base(raw)  # a Hub id is the model's own name; a local path a label
                (names if base is not None and "/" in base else labels).append(base or raw)
    except Exception as exc:  # noqa: BLE001 - the model's own checks say what is wrong with its files
        log.debug("model identity of %s not read: %s", path, exc)
    return ModelIdentity(tuple(dict.fromkeys(names)), tuple(dict.fromkeys(labels)))


def check_base_model(config: dict, identity: ModelIdentity | None, where: str) -> None:
    """Refuse an adapter whose ``base_model_name_or_path`` clearly names another model than
    ``identity``'s (module docstring); when it cannot be compared, log why and return.

    Args:
        config: the adapter's ``adapter_config.json``.
        identity: the worker's model (:func:`model_identity`); None: not known, nothing compared.
        where: the adapter, as messages name it (``LoRA adapter 'sql' (/path)``).

    Raises:
        ValueError: ``{where}: trained on 'X', this worker's model is 'Y' ...: base model mismatch``.
    """
    base, why = adapter_base(config.get("base_model_name_or_path"))
    if base is None:
        log.info("%s %s; loaded without comparing it with the model's", where, why)
        return
    if identity is None or not identity.known:
        log.info("%s was trained on %r; this worker's model names itself nothing to compare it with "
                 "(%s); loaded", where, base, identity.describe() if identity else "unnamed")
        return
    wanted = name_tokens(base)
    if not wanted or any(_matches(wanted, name_tokens(n)) for n in (*identity.names, *identity.labels)):
        return
    raise ValueError(f"{where}: trained on {base[:200]!r}, this worker's model is {identity.describe()}: base model "
                     "mismatch (if the adapter does fit this model, set base_model_name_or_path in its "
                     "adapter_config.json to the model's name, or remove it)")
