"""Per-request sampling parameters (OpenAI/vLLM meanings)."""

from __future__ import annotations

import math
from dataclasses import dataclass

MAX_LOGPROBS = 20


@dataclass(frozen=True)
class GrammarSpec:
    """A grammar the output must match (structured outputs), as the engine compiles it.

    Attributes:
        key: the compiled grammar's cache key (``common.structured_outputs`` hashes the
            client's spec with SHA-256); equal keys share one compile.
        grammar: llguidance's grammar text (``StructuredOutputs.grammar()`` built it).
        error: why the spec could not be turned into a grammar ("" = none): the request is
            refused as INVALID.
    """

    key: str
    grammar: str
    error: str = ""


@dataclass(frozen=True)
class SamplingParams:
    """How to pick and when to stop generating tokens for one request.

    Attributes:
        max_tokens: most tokens to generate (>= 1); reaching it finishes with
            "length".
        temperature: 0 = greedy (argmax); > 0 divides the logits.
        top_p: nucleus sampling: keep the smallest set of most likely tokens
            whose probability sums to >= top_p (Holtzman et al. ICLR'20); 1 = off.
        top_k: keep the k most likely tokens; 0 or -1 = off.
        seed: makes the random draws of this request depend only on
            (seed, index of the token in the output), whatever else is batched.
        stop: strings that end the output (finish "stop"); the output is cut
            before the first occurrence.
        stop_token_ids: token ids that end the output (finish "stop"); the id
            is returned and counted, its text is not.
        ignore_eos: keep generating past the tokenizer's EOS tokens.
        logprobs: number of top alternatives (0..20) to return per token.
        return_logprobs: return the sampled token's log-probability (implied
            by ``logprobs > 0``).
        skip_special_tokens: leave special tokens out of the text.
        presence_penalty: OpenAI's, in [-2, 2]: subtracted from the logit of every
            token that already occurs in the output (0 = off).
        frequency_penalty: OpenAI's, in [-2, 2]: times a token's count in the output,
            subtracted from its logit (0 = off).
        repetition_penalty: vLLM's and transformers' (Keskar et al. 2019, CTRL), > 0:
            a token seen in the prompt or the output has a positive logit divided
            by it and a negative one multiplied (1 = off).
        min_p: in [0, 1]: after temperature, drop tokens whose probability is below
            ``min_p`` times the most likely token's (Nguyen et al. 2024; 0 = off).
        min_tokens: EOS and ``stop_token_ids`` are masked until the output has this
            many tokens (vLLM's meaning; stop strings still stop).
        logit_bias: (token id, bias) pairs, bias in [-100, 100], added to the logits
            before sampling (OpenAI's ``logit_bias``).
        grammar: grammar-constrained decoding (structured outputs): only tokens that keep
            the output a prefix of the grammar's language are sampled, and EOS only once
            it is complete; None = free text.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int = 0
    return_logprobs: bool = False
    skip_special_tokens: bool = True
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    min_tokens: int = 0
    logit_bias: tuple[tuple[int, float], ...] = ()
    grammar: GrammarSpec | None = None

    def __post_init__(self) -> None:
        # Accept lists/strings/dicts from callers but store hashable tuples.
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        object.__setattr__(self, "stop", stop)
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        bias = self.logit_bias.items() if isinstance(self.logit_bias, dict) else self.logit_bias
        object.__setattr__(self, "logit_bias", tuple(sorted((int(t), float(b)) for t, b in bias)))

    @property
    def penalizes(self) -> bool:
        """True when a penalty reads the request's token history."""
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    @property
    def greedy(self) -> bool:
        """True when the token is the argmax (temperature 0)."""
        return self.temperature == 0.0

    @property
    def wants_logprobs(self) -> bool:
        """True when the sampled token's logprob must be returned."""
        return self.return_logprobs or self.logprobs > 0

    def validate(self, vocab_size: int) -> None:
        """Check every field against its range.

        Args:
            vocab_size: the model's vocabulary size (bounds top_k and ids).

        Raises:
            ValueError: naming the first field out of range.
        """
        _check(isinstance(self.max_tokens, int) and self.max_tokens >= 1, f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        _check(_finite(self.temperature) and self.temperature >= 0, f"temperature must be a finite number >= 0, got {self.temperature!r}")
        _check(_finite(self.top_p) and 0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p!r}")
        _check(isinstance(self.top_k, int) and (self.top_k in (-1, 0) or 1 <= self.top_k <= vocab_size),
               f"top_k must be -1, 0 (off) or in [1, {vocab_size}], got {self.top_k!r}")
        _check(self.seed is None or isinstance(self.seed, int), f"seed must be an integer, got {self.seed!r}")
        _check(all(isinstance(s, str) and s for s in self.stop), "stop strings must be non-empty strings")
        _check(all(isinstance(t, int) and 0 <= t < vocab_size for t in self.stop_token_ids),
               f"stop_token_ids must be token ids in [0, {vocab_size})")
        _check(isinstance(self.logprobs, int) and 0 <= self.logprobs <= MAX_LOGPROBS,
               f"logprobs must be an integer in [0, {MAX_LOGPROBS}], got {self.logprobs!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(_finite(value) and -2 <= value <= 2, f"{name} must be in [-2, 2], got {value!r}")
        _check(_finite(self.repetition_penalty) and self.repetition_penalty > 0,
               f"repetition_penalty must be a finite number > 0, got {self.repetition_penalty!r}")
        _check(_finite(self.min_p) and 0 <= self.min_p <= 1, f"min_p must be in [0, 1], got {self.min_p!r}")
        _check(isinstance(self.min_tokens, int) and 0 <= self.min_tokens <= self.max_tokens,
               f"min_tokens must be an integer in [0, max_tokens], got {self.min_tokens!r}")
        _check(all(0 <= t < vocab_size and _finite(b) and -100 <= b <= 100 for t, b in self.logit_bias),
               f"logit_bias must map token ids in [0, {vocab_size}) to numbers in [-100, 100]")


def _finite(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)
