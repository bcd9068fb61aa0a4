"""Incremental detokenization with stop strings.

Text is produced the way HF TGI and vLLM do it (no code copied): decode a
short window of tokens before and after the last emitted point and emit the
difference, holding back while the window ends in U+FFFD (a character whose
bytes are split across tokens). Stop strings cut the text at their first
occurrence; only the longest tail that could still start a stop string is
held back.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

REPLACEMENT = "\ufffd"
_PROMPT_CONTEXT_TOKENS = 4


class TokenDecoder(Protocol):
    """What the detokenizer needs from a tokenizer (see CONTRACTS.md)."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """Text of token ids ``ids``; a character cut across the end decodes as U+FFFD."""
        ...


@dataclass(frozen=True)
class DetokenizerUpdate:
    """Result of feeding one token.

    Attributes:
        text_delta: new text safe to emit now ("" if held back).
        stopped: True when a stop string was found (the sequence must end
            with finish reason "stop"; later tokens are ignored).
    """

    text_delta: str
    stopped: bool = False


class IncrementalDetokenizer:
    """Turns a stream of token ids into text deltas.

    Guarantees: never emits U+FFFD for a character split across tokens, never
    emits a character twice, keeps leading spaces (the window starts with up
    to 4 prompt tokens as context), and the joined deltas plus :meth:`flush`
    equal a one-shot decode of the same output tokens, cut before the first
    stop string (for byte-level BPE tokenizers).

    Args:
        tokenizer: anything with ``decode(ids, skip_special_tokens)``.
        prompt_token_ids: the prompt (its tail is decoding context only).
        stop: stop strings.
        skip_special_tokens: leave special tokens out of the text.
    """

    def __init__(self, tokenizer: TokenDecoder, prompt_token_ids: list[int], stop: tuple[str, ...] = (),
                 skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.stop = tuple(stop)
        self.skip_special_tokens = skip_special_tokens
        context = list(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:])
        if context and self._decode(context).endswith(REPLACEMENT):
            context = []  # a prompt ending mid-character gives no clean boundary
        self._ids = context
        self._prefix_offset = 0
        self._read_offset = len(context)
        self.text = ""  # all decoded output text so far (cut at a stop string)
        self._emitted = 0  # chars of self.text already returned
        self.stopped = False

    def resume(self, output_token_ids: list[int], emitted_text: str) -> None:
        """Replay output tokens generated elsewhere (a continuation) without
        emitting them again: feed them as if generated here, then mark the
        first ``len(emitted_text)`` characters of the text as already emitted,
        so a held-back tail (a possible stop string, a split character) is
        still emitted later and a stop string spanning the boundary is found.

        Raises:
            ValueError: ``emitted_text`` is not a prefix of the replayed text
                (the continuation was built with another tokenizer).
        """
        for token_id in output_token_ids:
            self.add_token(token_id)
        if not self.text.startswith(emitted_text):
            raise ValueError("the resumed text is not a prefix of the resumed tokens' text")
        self._emitted = len(emitted_text)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add_token(self, token_id: int) -> DetokenizerUpdate:
        """Feed one generated token; returns the text that may be emitted."""
        if self.stopped:
            return DetokenizerUpdate("", True)
        self._ids.append(token_id)
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset :])
        if len(new_text) <= len(prefix_text) or new_text.endswith(REPLACEMENT):
            return DetokenizerUpdate("")  # incomplete character (or no text yet): wait
        self.text += new_text[len(prefix_text) :]
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        return self._emit_checking_stop(len(self.text) - (len(new_text) - len(prefix_text)))

    def flush(self) -> str:
        """End of the sequence for a reason other than a stop string: emit
        everything held (text held for a possible stop string, and bytes of an
        incomplete character, which decode to U+FFFD as in a one-shot decode)."""
        if not self.stopped:
            prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
            new_text = self._decode(self._ids[self._prefix_offset :])
            if len(new_text) > len(prefix_text):
                self.text += new_text[len(prefix_text) :]
                self._prefix_offset = self._read_offset = len(self._ids)
        delta = self.text[self._emitted :]
        self._emitted = len(self.text)
        return delta

    def _emit_checking_stop(self, new_start: int) -> DetokenizerUpdate:
        if self.stop:
            cut = self._find_stop(new_start)
            if cut is not None:
                self.text = self.text[:cut]
                self.stopped = True
                return DetokenizerUpdate(self._take(len(self.text)), True)
        return DetokenizerUpdate(self._take(len(self.text) - self._held_tail()))

    def _find_stop(self, new_start: int) -> int | None:
        """Earliest stop-string start that overlaps the newly added text."""
        longest = max(len(s) for s in self.stop)
        search_from = max(0, new_start - longest + 1)
        hits = [i for s in self.stop if (i := self.text.find(s, search_from)) != -1]
        return min(hits) if hits else None

    def _held_tail(self) -> int:
        """Length of the longest suffix of the unemitted text that is a
        proper prefix of some stop string."""
        pending = self.text[self._emitted :]
        for n in range(min(len(pending), max((len(s) for s in self.stop), default=1) - 1), 0, -1):
            tail = pending[-n:]
            if any(s.startswith(tail) for s in self.stop):
                return n
        return 0

    def _take(self, end: int) -> str:
        delta = self.text[self._emitted : end]
        self._emitted = max(self._emitted, end)
        return delta
