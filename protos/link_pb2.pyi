from protos import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class WorkerMessage(_message.Message):
    __slots__ = ("hello", "accepted", "step")
    HELLO_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    hello: Hello
    accepted: Accepted
    step: StepOutput
    def __init__(self, hello: _Optional[_Union[Hello, _Mapping]] = ..., accepted: _Optional[_Union[Accepted, _Mapping]] = ..., step: _Optional[_Union[StepOutput, _Mapping]] = ...) -> None: ...

class Hello(_message.Message):
    __slots__ = ("worker_id", "model")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    model: str
    def __init__(self, worker_id: _Optional[str] = ..., model: _Optional[str] = ...) -> None: ...

class Accepted(_message.Message):
    __slots__ = ("request_id", "worker_id", "queue_time_s", "attempt")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    QUEUE_TIME_S_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    worker_id: str
    queue_time_s: float
    attempt: int
    def __init__(self, request_id: _Optional[str] = ..., worker_id: _Optional[str] = ..., queue_time_s: _Optional[float] = ..., attempt: _Optional[int] = ...) -> None: ...

class Delta(_message.Message):
    __slots__ = ("request_id", "text", "token_ids", "logprobs", "index")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    text: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprob]
    index: int
    def __init__(self, request_id: _Optional[str] = ..., text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprob, _Mapping]]] = ..., index: _Optional[int] = ...) -> None: ...

class Finished(_message.Message):
    __slots__ = ("request_id", "finish_reason", "usage", "error", "error_code", "index")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    ERROR_CODE_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    finish_reason: _common_pb2.FinishReason
    usage: _common_pb2.Usage
    error: str
    error_code: str
    index: int
    def __init__(self, request_id: _Optional[str] = ..., finish_reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ..., usage: _Optional[_Union[_common_pb2.Usage, _Mapping]] = ..., error: _Optional[str] = ..., error_code: _Optional[str] = ..., index: _Optional[int] = ...) -> None: ...

class StepOutput(_message.Message):
    __slots__ = ("deltas", "finished", "embeddings")
    DELTAS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    EMBEDDINGS_FIELD_NUMBER: _ClassVar[int]
    deltas: _containers.RepeatedCompositeFieldContainer[Delta]
    finished: _containers.RepeatedCompositeFieldContainer[Finished]
    embeddings: _containers.RepeatedCompositeFieldContainer[Embedding]
    def __init__(self, deltas: _Optional[_Iterable[_Union[Delta, _Mapping]]] = ..., finished: _Optional[_Iterable[_Union[Finished, _Mapping]]] = ..., embeddings: _Optional[_Iterable[_Union[Embedding, _Mapping]]] = ...) -> None: ...

class Embedding(_message.Message):
    __slots__ = ("request_id", "values", "prompt_tokens")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    values: _containers.RepeatedScalarFieldContainer[float]
    prompt_tokens: int
    def __init__(self, request_id: _Optional[str] = ..., values: _Optional[_Iterable[float]] = ..., prompt_tokens: _Optional[int] = ...) -> None: ...

class GatewayMessage(_message.Message):
    __slots__ = ("ack", "cancel")
    ACK_FIELD_NUMBER: _ClassVar[int]
    CANCEL_FIELD_NUMBER: _ClassVar[int]
    ack: Ack
    cancel: Cancel
    def __init__(self, ack: _Optional[_Union[Ack, _Mapping]] = ..., cancel: _Optional[_Union[Cancel, _Mapping]] = ...) -> None: ...

class Ack(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class Cancel(_message.Message):
    __slots__ = ("request_id", "attempt", "attempt_plus_one")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_PLUS_ONE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    attempt: int
    attempt_plus_one: int
    def __init__(self, request_id: _Optional[str] = ..., attempt: _Optional[int] = ..., attempt_plus_one: _Optional[int] = ...) -> None: ...
