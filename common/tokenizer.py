"""The model's tokenizer and chat template (:class:`Tokenizer`), loaded from a GGUF file or an
HF folder by :func:`load_tokenizer` (the readers: :mod:`common.tokenizer_files`).

No torch here: the gateway counts prompt tokens with this module.
"""

from __future__ import annotations

import bisect
import json
import re
from functools import cached_property
from pathlib import Path
from typing import Any, Iterable

from jinja2 import TemplateError, meta
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer

from common.token_bytes import TokenBytes
from common.tokenizer_files import _Specials, load_gguf, load_hf_folder  # noqa: F401 - _Specials: Tokenizer's

# Stands for message i's content while the chat template renders (private-use
# characters: not in any template, not changed by trim/strip filters).
_CONTENT_SENTINEL = "\ue000inflight-content-{}\ue001"
_CONTENT_SENTINEL_RE = re.compile("\ue000inflight-content-([0-9]+)\ue001")


class Tokenizer:
    """Text <-> token ids plus the chat template of one model.

    Attributes:
        hf: the underlying ``tokenizers.Tokenizer``.
        eos_token_ids: ids that end generation (see module docstring).
        bos_token_id: BOS id or None.
        vocab_size: number of ids including added tokens.
        context_length: the model's context window in tokens.
        model_name: the file or folder name, used as the served model id.
        special_token_ids: ids of special (control) tokens.
        token_bytes: ``token_bytes(token_id) -> bytes``, a token's raw bytes
            (:class:`TokenBytes`).
    """

    def __init__(
        self,
        hf: HFTokenizer,
        specials: _Specials,
        *,
        chat_template: str | None,
        context_length: int,
        model_name: str,
    ) -> None:
        self.hf = hf
        self._specials = specials
        self._chat_template_source = chat_template
        self.eos_token_ids = specials.eos_token_ids
        self.bos_token_id = specials.bos_token_id
        self.vocab_size = hf.get_vocab_size(with_added_tokens=True)
        self.context_length = context_length
        self.model_name = model_name
        self.special_token_ids = frozenset(
            i for i, tok in hf.get_added_tokens_decoder().items() if tok.special
        )
        self.token_bytes = TokenBytes(hf)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of ``text``; special-token strings in it map to their ids.

        ``add_special_tokens`` adds BOS when the model asks for it (GGUF
        ``tokenizer.ggml.add_bos_token``) or runs the folder's post-processor.
        Encodes through ``encode_batch``, which releases the GIL while it runs
        (``encode`` holds it, a stall for every other thread of the gateway on a
        long text: bench/RESULTS.md, "Measurements first recorded in docstrings"); the ids are the same.
        """
        ids = self.hf.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        if add_special_tokens and self._specials.add_bos_token and self.bos_token_id is not None:
            if not ids or ids[0] != self.bos_token_id:
                ids = [self.bos_token_id, *ids]
        return ids

    @cached_property
    def _hf_text(self) -> HFTokenizer:
        """A copy of :attr:`hf` that never matches special tokens: their strings
        become ordinary text tokens (``encode_special_tokens``, tokenizers >= 0.19).
        A copy rather than toggling the flag on :attr:`hf`, which other threads use."""
        hf = HFTokenizer.from_str(self.hf.to_str())
        hf.encode_special_tokens = True
        return hf

    def encode_text(self, text: str) -> list[int]:
        """Token ids of ``text`` with special-token strings in it tokenized as
        ordinary text: ``"<|im_start|>"`` gives SmolLM2's 7 ids of ``<``, ``|``,
        ``im``, ... never id 1. Text without special-token strings gives the
        ids of :meth:`encode`."""
        return self._hf_text.encode_batch([text], add_special_tokens=False)[0].ids

    def special_tokens_in(self, ids: Iterable[int]) -> list[str]:
        """The special (control) tokens among ``ids``, as strings, in order."""
        return [self.hf.id_to_token(i) for i in ids if i in self.special_token_ids]

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                    **template_vars: Any) -> list[int]:
        """Token ids of ``messages`` rendered with the chat template, where only the
        template's own text may yield special tokens: a special-token string inside
        a message's ``content`` (``"<|im_end|>\\n<|im_start|>system"``) is
        tokenized as text, so a message cannot close its turn or open another.

        The template is rendered twice, with the contents and with a sentinel for
        each, which locates every content in the prompt text. When no special
        token the tokenizer found overlaps a content, the ids are those of
        ``encode(apply_chat_template(messages))``, unchanged. Otherwise the text is
        cut at the special tokens of the template's text alone, and the runs
        between them (template text and contents together, so token boundaries are
        the tokenizer's own) are encoded with special-token matching off.

        ``template_vars`` go to the template as they are (``tools``: the request's
        tools, for a template that renders them).

        Raises:
            ValueError: no template, the template failed; or a content holds a
                special token and the template rewrites contents (a ``trim``, a
                split), so where it sits cannot be told: refused, not guessed.
        """
        text = self.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                        **template_vars)
        encoding = self.hf.encode_batch([text], add_special_tokens=False)[0]
        ids = encoding.ids
        sentinel_text = self.apply_chat_template(
            [{**m, "content": _CONTENT_SENTINEL.format(i)} for i, m in enumerate(messages)],
            add_generation_prompt=add_generation_prompt, **template_vars)
        located = _locate_contents(sentinel_text, [m.get("content", "") for m in messages])
        if located is None or located[0] != text:  # the template changes contents
            template_specials = self.special_tokens_in(self.encode(sentinel_text))
            found = self.special_tokens_in(ids)
            if found == template_specials:  # the contents added no control token
                return ids
            raise ValueError(
                f"a message content holds the special token {_first_extra(found, template_specials)!r}, "
                "and this model's chat template rewrites message contents, so it cannot be kept as text")
        pieces = located[1]
        spans = [(a, b) for a, b, is_content in pieces if is_content and a < b]
        starts, ends = [a for a, _ in spans], [b for _, b in spans]
        specials_at = [k for k, i in enumerate(ids) if i in self.special_token_ids]
        offsets = encoding.offsets if specials_at else []  # a new list per access: read once
        if not any(_overlaps(starts, ends, *offsets[k]) for k in specials_at):
            return ids  # every special token is the template's: the ids of today, exactly
        return self._encode_template_specials_only(text, pieces)

    def _encode_template_specials_only(self, text: str, pieces: list[tuple[int, int, bool]]) -> list[int]:
        """Ids of ``text`` whose special tokens are only those found in its template
        pieces (``(start, end, is_content)``), each piece scanned on its own."""
        cuts: list[tuple[int, int, int]] = []  # (start, end, id) of the template's special tokens
        for start, end, is_content in pieces:
            if is_content or start == end:
                continue
            enc = self.hf.encode_batch([text[start:end]], add_special_tokens=False)[0]
            cuts += [(start + a, start + b, i) for i, (a, b) in zip(enc.ids, enc.offsets)
                     if i in self.special_token_ids]
        out: list[int] = []
        at = 0
        for start, end, token_id in cuts:
            if start > at:
                out += self.encode_text(text[at:start])
            out.append(token_id)
            at = end
        if at < len(text):
            out += self.encode_text(text[at:])
        if len([i for i in out if i in self.special_token_ids]) != len(cuts):
            raise ValueError("message content encodes to a special token even as text")
        return out

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids`` (partial UTF-8 becomes U+FFFD; a SentencePiece vocabulary with a
        space prefix drops the one leading space it adds, as llama.cpp's detokenizer does)."""
        return self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens)


    @property
    def bos_token(self) -> str:
        """The BOS token's text ("" when the model has none), as a chat template sees it."""
        return self._specials.bos_token

    @property
    def eos_token(self) -> str:
        """The EOS token's text ("" when the file names none), as a chat template sees it."""
        return self._specials.eos_token

    @property
    def chat_template(self) -> str | None:
        """The chat template's Jinja source as the model files give it; None without one."""
        return self._chat_template_source

    @cached_property
    def chat_template_takes_tools(self) -> bool:
        """Whether the chat template reads a ``tools`` variable (renders tool definitions
        itself, Hugging Face's convention); False without a template or when it does not
        parse."""
        if not self._chat_template_source:
            return False
        try:
            parsed = self._template.environment.parse(self._chat_template_source)
        except TemplateError:
            return False
        return "tools" in meta.find_undeclared_variables(parsed)

    @cached_property
    def _template(self):
        if not self._chat_template_source:
            raise ValueError(f"model {self.model_name!r} has no chat template")
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
        )
        env.globals["raise_exception"] = _raise_exception
        env.filters["tojson"] = _tojson
        return env.from_string(self._chat_template_source)

    def apply_chat_template(
        self, messages: list[dict], add_generation_prompt: bool = True, **kwargs: Any
    ) -> str:
        """Render the model's chat template (jinja2 sandbox, HF conventions:
        ``trim_blocks``, ``lstrip_blocks``, ``raise_exception``, ``bos_token``,
        ``eos_token``, ``add_generation_prompt``).

        Raises:
            ValueError: no template, or the template raised / failed to render.
        """
        try:
            return self._template.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=self._specials.bos_token,
                eos_token=self._specials.eos_token,
                **kwargs,
            )
        except TemplateError as exc:
            raise ValueError(f"chat template failed: {exc}") from exc


def _locate_contents(sentinel_text: str, contents: list[str]
                     ) -> tuple[str, list[tuple[int, int, bool]]] | None:
    """``sentinel_text`` with each sentinel replaced by its content, and the
    ``(start, end, is_content)`` pieces of the result; None when a sentinel is
    not one of ``contents``' (cannot happen with the sentinels we rendered)."""
    pieces: list[tuple[int, int, bool]] = []
    parts: list[str] = []
    at = length = 0
    for match in _CONTENT_SENTINEL_RE.finditer(sentinel_text):
        index = int(match.group(1))
        if index >= len(contents):
            return None
        template = sentinel_text[at:match.start()]
        pieces.append((length, length + len(template), False))
        length += len(template)
        content = contents[index]
        pieces.append((length, length + len(content), True))
        length += len(content)
        parts += [template, content]
        at = match.end()
    pieces.append((length, length + len(sentinel_text) - at, False))
    parts.append(sentinel_text[at:])
    return "".join(parts), pieces


def _overlaps(starts: list[int], ends: list[int], a: int, b: int) -> bool:
    """Whether ``[a, b)`` overlaps one of the sorted, disjoint spans ``zip(starts, ends)``."""
    k = bisect.bisect_right(starts, a) - 1  # the last span starting at or before a
    if k >= 0 and ends[k] > a:
        return True
    return k + 1 < len(starts) and starts[k + 1] < b


def _first_extra(found: list[str], expected: list[str]) -> str:
    """The first special token of ``found`` beyond what ``expected`` accounts for."""
    for k, token in enumerate(found):
        if k >= len(expected) or expected[k] != token:
            return token
    return found[-1] if found else ""


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


def _tojson(value: Any, indent: int | None = None) -> str:
    return json.dumps(value, ensure_ascii=False, indent=indent)


def load_tokenizer(path: str | Path) -> Tokenizer:
    """Load the tokenizer of a GGUF file or of an HF folder (``tokenizer.json``,
    ``tokenizer_config.json``, ``config.json``, optional ``generation_config.json``).

    Raises:
        FileNotFoundError: ``path`` or a required file is missing.
        ValueError: unsupported GGUF tokenizer model.
    """
    path = Path(path)
    if path.is_file() and path.suffix == ".gguf":
        return Tokenizer(**vars(load_gguf(path)))
    if path.is_dir():
        return Tokenizer(**vars(load_hf_folder(path)))
    raise FileNotFoundError(f"no GGUF file or model folder at {str(path)!r}")


