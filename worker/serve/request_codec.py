"""Conversions between the queue/link protobufs and the engine's own types."""

from __future__ import annotations

import time

from common.structured_outputs import StructuredOutputs
from protos import common_pb2, queue_pb2
from worker.engine.engine import EngineRequest
from worker.engine.engine_types import PoolingParams
from worker.engine.sampling_params import GrammarSpec, SamplingParams

#: Engine finish reasons → link protobuf enum.
FINISH_REASONS = {
    "stop": common_pb2.FINISH_REASON_STOP,
    "length": common_pb2.FINISH_REASON_LENGTH,
    "abort": common_pb2.FINISH_REASON_ABORT,
    "error": common_pb2.FINISH_REASON_ERROR,
}


def to_sampling_params(p: common_pb2.SamplingParams) -> SamplingParams:
    """Protobuf sampling parameters → engine ``SamplingParams`` (``Sampling.from_proto``:
    an unset optional takes its default from ``common.sampling.PARAMS``, the OpenAI ones:
    temperature 1.0, top_p 1.0, top_k off, every penalty off)."""
    return SamplingParams.from_proto(p, grammar=to_grammar_spec(p.structured_outputs))


def to_grammar_spec(message: common_pb2.StructuredOutputs) -> GrammarSpec | None:
    """The engine's :class:`GrammarSpec` of a queued ``StructuredOutputs`` (None when unset);
    a spec that does not convert (the gateway checks them, a hand-made entry may not be)
    carries the reason in ``error``, and the engine refuses the request."""
    spec = StructuredOutputs.from_proto(message)
    if spec is None:
        return None
    try:
        return GrammarSpec(spec.key(), spec.grammar())
    except ValueError as exc:
        return GrammarSpec(spec.key(), "", f"structured_outputs: {exc}")


def to_engine_request(q: queue_pb2.QueuedRequest) -> EngineRequest:
    """A queued request → the engine's ``EngineRequest`` (arrival = now, monotonic seconds)."""
    return EngineRequest(
        request_id=q.request_id,
        prompt_token_ids=list(q.prompt_token_ids),
        sampling_params=to_sampling_params(q.sampling),
        arrival_time=time.monotonic(),
        priority=q.priority,
        tenant=q.tenant,
        resumed_token_ids=list(q.resumed_token_ids),
        resumed_text=q.resumed_text,
        n=max(1, q.sampling.n),
        lora_name=q.lora_name,
        pooling=(PoolingParams(dimensions=q.embedding.dimensions, normalize=q.embedding.normalize)
                 if q.HasField("embedding") else None),
    )


def to_logprobs_proto(items, tokenizer) -> list[common_pb2.TokenLogprob]:
    """Engine ``TokenLogprob``s (sampled token + top alternatives, natural log) →
    protobuf, with each token's text (special tokens included) and raw bytes
    (``tokenizer.token_bytes``: part of a UTF-8 character where the token splits one,
    where the text shows U+FFFD)."""
    def text(token_id: int) -> str:
        return tokenizer.decode([token_id], skip_special_tokens=False)
    return [common_pb2.TokenLogprob(
        token_id=t.token_id, logprob=t.logprob, token=text(t.token_id), token_bytes=tokenizer.token_bytes(t.token_id),
        top=[common_pb2.TopLogprob(token_id=a, logprob=lp, token=text(a), token_bytes=tokenizer.token_bytes(a))
             for a, lp in t.top])
        for t in items]
