from protos import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class QueuedRequest(_message.Message):
    __slots__ = ("request_id", "tenant", "prompt_token_ids", "sampling", "priority", "deadline_unix_s", "reply_to", "enqueued_unix_s", "model", "key_id", "cost", "resumed_token_ids", "resumed_text", "attempt", "traceparent", "lora_name", "embedding")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_UNIX_S_FIELD_NUMBER: _ClassVar[int]
    REPLY_TO_FIELD_NUMBER: _ClassVar[int]
    ENQUEUED_UNIX_S_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    KEY_ID_FIELD_NUMBER: _ClassVar[int]
    COST_FIELD_NUMBER: _ClassVar[int]
    RESUMED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    RESUMED_TEXT_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    TRACEPARENT_FIELD_NUMBER: _ClassVar[int]
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    EMBEDDING_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    tenant: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    priority: int
    deadline_unix_s: float
    reply_to: str
    enqueued_unix_s: float
    model: str
    key_id: str
    cost: int
    resumed_token_ids: _containers.RepeatedScalarFieldContainer[int]
    resumed_text: str
    attempt: int
    traceparent: str
    lora_name: str
    embedding: _common_pb2.EmbeddingParams
    def __init__(self, request_id: _Optional[str] = ..., tenant: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., priority: _Optional[int] = ..., deadline_unix_s: _Optional[float] = ..., reply_to: _Optional[str] = ..., enqueued_unix_s: _Optional[float] = ..., model: _Optional[str] = ..., key_id: _Optional[str] = ..., cost: _Optional[int] = ..., resumed_token_ids: _Optional[_Iterable[int]] = ..., resumed_text: _Optional[str] = ..., attempt: _Optional[int] = ..., traceparent: _Optional[str] = ..., lora_name: _Optional[str] = ..., embedding: _Optional[_Union[_common_pb2.EmbeddingParams, _Mapping]] = ...) -> None: ...
