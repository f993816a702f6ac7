from proto.pdserve.v1 import inference_pb2 as _inference_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GetStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerStatus(_message.Message):
    __slots__ = ("worker_id", "role", "draining", "num_waiting", "num_running", "waiting_tokens", "free_blocks", "total_blocks", "block_size", "kv_endpoint", "epoch", "metrics_port", "engine_steps", "engine_step_wall_s", "engine_step_cpu_s", "node", "num_receiving")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    WAITING_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    KV_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    METRICS_PORT_FIELD_NUMBER: _ClassVar[int]
    ENGINE_STEPS_FIELD_NUMBER: _ClassVar[int]
    ENGINE_STEP_WALL_S_FIELD_NUMBER: _ClassVar[int]
    ENGINE_STEP_CPU_S_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    NUM_RECEIVING_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    role: str
    draining: bool
    num_waiting: int
    num_running: int
    waiting_tokens: int
    free_blocks: int
    total_blocks: int
    block_size: int
    kv_endpoint: str
    epoch: int
    metrics_port: int
    engine_steps: int
    engine_step_wall_s: float
    engine_step_cpu_s: float
    node: str
    num_receiving: int
    def __init__(self, worker_id: _Optional[str] = ..., role: _Optional[str] = ..., draining: _Optional[bool] = ..., num_waiting: _Optional[int] = ..., num_running: _Optional[int] = ..., waiting_tokens: _Optional[int] = ..., free_blocks: _Optional[int] = ..., total_blocks: _Optional[int] = ..., block_size: _Optional[int] = ..., kv_endpoint: _Optional[str] = ..., epoch: _Optional[int] = ..., metrics_port: _Optional[int] = ..., engine_steps: _Optional[int] = ..., engine_step_wall_s: _Optional[float] = ..., engine_step_cpu_s: _Optional[float] = ..., node: _Optional[str] = ..., num_receiving: _Optional[int] = ...) -> None: ...

class KVLayout(_message.Message):
    __slots__ = ("model_name", "dtype", "block_size", "num_layers", "num_kv_heads", "head_dim", "cache_dtype")
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    CACHE_DTYPE_FIELD_NUMBER: _ClassVar[int]
    model_name: str
    dtype: str
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    cache_dtype: str
    def __init__(self, model_name: _Optional[str] = ..., dtype: _Optional[str] = ..., block_size: _Optional[int] = ..., num_layers: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., cache_dtype: _Optional[str] = ...) -> None: ...

class TransferTicket(_message.Message):
    __slots__ = ("transfer_id", "epoch", "block_ids", "layout", "kv_endpoint", "decode_worker_id", "num_tokens", "timeout_ms", "request_id")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    KV_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    DECODE_WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    epoch: int
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    layout: KVLayout
    kv_endpoint: str
    decode_worker_id: str
    num_tokens: int
    timeout_ms: int
    request_id: str
    def __init__(self, transfer_id: _Optional[str] = ..., epoch: _Optional[int] = ..., block_ids: _Optional[_Iterable[int]] = ..., layout: _Optional[_Union[KVLayout, _Mapping]] = ..., kv_endpoint: _Optional[str] = ..., decode_worker_id: _Optional[str] = ..., num_tokens: _Optional[int] = ..., timeout_ms: _Optional[int] = ..., request_id: _Optional[str] = ...) -> None: ...

class ReserveRequest(_message.Message):
    __slots__ = ("request_id", "num_prompt_tokens", "max_tokens", "timeout_s")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    num_prompt_tokens: int
    max_tokens: int
    timeout_s: float
    def __init__(self, request_id: _Optional[str] = ..., num_prompt_tokens: _Optional[int] = ..., max_tokens: _Optional[int] = ..., timeout_s: _Optional[float] = ...) -> None: ...

class ReserveResponse(_message.Message):
    __slots__ = ("ticket",)
    TICKET_FIELD_NUMBER: _ClassVar[int]
    ticket: TransferTicket
    def __init__(self, ticket: _Optional[_Union[TransferTicket, _Mapping]] = ...) -> None: ...

class WorkerSampling(_message.Message):
    __slots__ = ("max_tokens", "temperature", "top_p", "top_k", "has_seed", "seed", "stop_token_ids", "ignore_eos", "min_tokens", "logprobs", "num_sampled", "structured_outputs", "no_speculation")
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    HAS_SEED_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    NUM_SAMPLED_FIELD_NUMBER: _ClassVar[int]
    STRUCTURED_OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    NO_SPECULATION_FIELD_NUMBER: _ClassVar[int]
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    has_seed: bool
    seed: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    min_tokens: int
    logprobs: int
    num_sampled: int
    structured_outputs: _inference_pb2.StructuredOutputs
    no_speculation: bool
    def __init__(self, max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., has_seed: _Optional[bool] = ..., seed: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., min_tokens: _Optional[int] = ..., logprobs: _Optional[int] = ..., num_sampled: _Optional[int] = ..., structured_outputs: _Optional[_Union[_inference_pb2.StructuredOutputs, _Mapping]] = ..., no_speculation: _Optional[bool] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "ticket", "timeout_s")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    TICKET_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: WorkerSampling
    ticket: TransferTicket
    timeout_s: float
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[WorkerSampling, _Mapping]] = ..., ticket: _Optional[_Union[TransferTicket, _Mapping]] = ..., timeout_s: _Optional[float] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("first_token", "cached_tokens", "queue_ms", "compute_ms", "transfer_ms", "finished", "finish_reason", "first_logprob", "kv_bytes", "kv_layers", "kv_plane", "kv_total_ms")
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_MS_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_MS_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_MS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    FIRST_LOGPROB_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_FIELD_NUMBER: _ClassVar[int]
    KV_LAYERS_FIELD_NUMBER: _ClassVar[int]
    KV_PLANE_FIELD_NUMBER: _ClassVar[int]
    KV_TOTAL_MS_FIELD_NUMBER: _ClassVar[int]
    first_token: int
    cached_tokens: int
    queue_ms: float
    compute_ms: float
    transfer_ms: float
    finished: bool
    finish_reason: str
    first_logprob: _inference_pb2.TokenLogprob
    kv_bytes: int
    kv_layers: int
    kv_plane: str
    kv_total_ms: float
    def __init__(self, first_token: _Optional[int] = ..., cached_tokens: _Optional[int] = ..., queue_ms: _Optional[float] = ..., compute_ms: _Optional[float] = ..., transfer_ms: _Optional[float] = ..., finished: _Optional[bool] = ..., finish_reason: _Optional[str] = ..., first_logprob: _Optional[_Union[_inference_pb2.TokenLogprob, _Mapping]] = ..., kv_bytes: _Optional[int] = ..., kv_layers: _Optional[int] = ..., kv_plane: _Optional[str] = ..., kv_total_ms: _Optional[float] = ...) -> None: ...

class DecodeRequest(_message.Message):
    __slots__ = ("request_id", "transfer_id", "prompt_token_ids", "first_token", "sampling", "timeout_s")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    transfer_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    first_token: int
    sampling: WorkerSampling
    timeout_s: float
    def __init__(self, request_id: _Optional[str] = ..., transfer_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., first_token: _Optional[int] = ..., sampling: _Optional[_Union[WorkerSampling, _Mapping]] = ..., timeout_s: _Optional[float] = ...) -> None: ...

class WorkerGenerateRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "timeout_s")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: WorkerSampling
    timeout_s: float
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[WorkerSampling, _Mapping]] = ..., timeout_s: _Optional[float] = ...) -> None: ...

class TokenChunk(_message.Message):
    __slots__ = ("token_ids", "finished", "finish_reason", "cached_tokens", "admission_ms", "first_step_ms", "logprobs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ADMISSION_MS_FIELD_NUMBER: _ClassVar[int]
    FIRST_STEP_MS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    finished: bool
    finish_reason: str
    cached_tokens: int
    admission_ms: float
    first_step_ms: float
    logprobs: _containers.RepeatedCompositeFieldContainer[_inference_pb2.TokenLogprob]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., finished: _Optional[bool] = ..., finish_reason: _Optional[str] = ..., cached_tokens: _Optional[int] = ..., admission_ms: _Optional[float] = ..., first_step_ms: _Optional[float] = ..., logprobs: _Optional[_Iterable[_Union[_inference_pb2.TokenLogprob, _Mapping]]] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ("found",)
    FOUND_FIELD_NUMBER: _ClassVar[int]
    found: bool
    def __init__(self, found: _Optional[bool] = ...) -> None: ...

class SetRoleRequest(_message.Message):
    __slots__ = ("role", "drain_timeout_s")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    DRAIN_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    role: str
    drain_timeout_s: float
    def __init__(self, role: _Optional[str] = ..., drain_timeout_s: _Optional[float] = ...) -> None: ...

class StreamKVEventsRequest(_message.Message):
    __slots__ = ("from_seq", "heartbeat_s")
    FROM_SEQ_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_S_FIELD_NUMBER: _ClassVar[int]
    from_seq: int
    heartbeat_s: float
    def __init__(self, from_seq: _Optional[int] = ..., heartbeat_s: _Optional[float] = ...) -> None: ...

class KVEvent(_message.Message):
    __slots__ = ("worker_id", "epoch", "seq", "kind", "block_hashes")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    epoch: int
    seq: int
    kind: str
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, worker_id: _Optional[str] = ..., epoch: _Optional[int] = ..., seq: _Optional[int] = ..., kind: _Optional[str] = ..., block_hashes: _Optional[_Iterable[bytes]] = ...) -> None: ...

class GetKVSnapshotRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class KVSnapshot(_message.Message):
    __slots__ = ("worker_id", "epoch", "seq", "block_hashes")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    epoch: int
    seq: int
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, worker_id: _Optional[str] = ..., epoch: _Optional[int] = ..., seq: _Optional[int] = ..., block_hashes: _Optional[_Iterable[bytes]] = ...) -> None: ...
