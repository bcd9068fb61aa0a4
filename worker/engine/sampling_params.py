"""Per-request sampling parameters (OpenAI/vLLM meanings): ``common.sampling.Sampling``
(fields, defaults, ranges: one table for the gateway and the worker) plus what only the
engine needs."""

from __future__ import annotations

from dataclasses import dataclass

from common.sampling import Sampling


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
class SamplingParams(Sampling):
    """How to pick and when to stop generating tokens for one request: the fields of
    :class:`common.sampling.Sampling` (their meanings and ranges are there), every scalar
    resolved to a value (an unset one takes ``common.sampling.PARAMS``' default:
    temperature 1, top_p 1, top_k 0 = off, every penalty off; seed stays None), and
    ``validate`` (``Sampling.validate``) raises ``ValueError`` naming the field.

    Attributes:
        grammar: grammar-constrained decoding (structured outputs): only tokens that keep
            the output a prefix of the grammar's language are sampled, and EOS only once
            it is complete; None = free text.
    """

    grammar: GrammarSpec | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        self._resolve_defaults()

    @property
    def greedy(self) -> bool:
        """True when the token is the argmax (temperature 0)."""
        return self.temperature == 0.0

    @property
    def wants_logprobs(self) -> bool:
        """True when the sampled token's logprob must be returned."""
        return self.return_logprobs or self.logprobs > 0
