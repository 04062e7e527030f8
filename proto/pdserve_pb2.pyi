from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SamplingParams(_message.Message):
    __slots__ = ("n", "temperature", "top_p", "top_k", "min_p", "seed", "max_tokens", "stop", "stop_token_ids", "ignore_eos", "logprobs", "include_stop_str_in_output", "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "min_tokens", "bad_words", "prior_output_tokens", "structured", "prompt_logprobs", "no_speculation", "lora")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    N_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_STOP_STR_IN_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BAD_WORDS_FIELD_NUMBER: _ClassVar[int]
    PRIOR_OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STRUCTURED_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    NO_SPECULATION_FIELD_NUMBER: _ClassVar[int]
    LORA_FIELD_NUMBER: _ClassVar[int]
    n: int
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    seed: int
    max_tokens: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    logprobs: int
    include_stop_str_in_output: bool
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    logit_bias: _containers.ScalarMap[int, float]
    min_tokens: int
    bad_words: _containers.RepeatedCompositeFieldContainer[TokenIds]
    prior_output_tokens: int
    structured: StructuredOutput
    prompt_logprobs: int
    no_speculation: bool
    lora: str
    def __init__(self, n: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., min_p: _Optional[float] = ..., seed: _Optional[int] = ..., max_tokens: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., logprobs: _Optional[int] = ..., include_stop_str_in_output: _Optional[bool] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., min_tokens: _Optional[int] = ..., bad_words: _Optional[_Iterable[_Union[TokenIds, _Mapping]]] = ..., prior_output_tokens: _Optional[int] = ..., structured: _Optional[_Union[StructuredOutput, _Mapping]] = ..., prompt_logprobs: _Optional[int] = ..., no_speculation: _Optional[bool] = ..., lora: _Optional[str] = ...) -> None: ...

class StructuredOutput(_message.Message):
    __slots__ = ("kind", "value")
    KIND_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    kind: str
    value: str
    def __init__(self, kind: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token_id", "logprob")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ...) -> None: ...

class TokenLogprobs(_message.Message):
    __slots__ = ("entries",)
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    entries: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    def __init__(self, entries: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ...) -> None: ...

class KVHandle(_message.Message):
    __slots__ = ("request_id", "worker_id", "epoch", "agent_name", "block_ids", "num_tokens", "compat_hash", "lease_expiry_unix", "first_token", "first_logprobs", "seed", "num_cached_tokens", "address")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    AGENT_NAME_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPAT_HASH_FIELD_NUMBER: _ClassVar[int]
    LEASE_EXPIRY_UNIX_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    FIRST_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    worker_id: str
    epoch: int
    agent_name: str
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    num_tokens: int
    compat_hash: str
    lease_expiry_unix: float
    first_token: int
    first_logprobs: TokenLogprobs
    seed: int
    num_cached_tokens: int
    address: str
    def __init__(self, request_id: _Optional[str] = ..., worker_id: _Optional[str] = ..., epoch: _Optional[int] = ..., agent_name: _Optional[str] = ..., block_ids: _Optional[_Iterable[int]] = ..., num_tokens: _Optional[int] = ..., compat_hash: _Optional[str] = ..., lease_expiry_unix: _Optional[float] = ..., first_token: _Optional[int] = ..., first_logprobs: _Optional[_Union[TokenLogprobs, _Mapping]] = ..., seed: _Optional[int] = ..., num_cached_tokens: _Optional[int] = ..., address: _Optional[str] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "params", "priority", "peer")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    PEER_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    params: SamplingParams
    priority: int
    peer: PeerPrefix
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., params: _Optional[_Union[SamplingParams, _Mapping]] = ..., priority: _Optional[int] = ..., peer: _Optional[_Union[PeerPrefix, _Mapping]] = ...) -> None: ...

class PeerPrefix(_message.Message):
    __slots__ = ("worker_id", "address", "num_blocks")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    address: str
    num_blocks: int
    def __init__(self, worker_id: _Optional[str] = ..., address: _Optional[str] = ..., num_blocks: _Optional[int] = ...) -> None: ...

class LendRequest(_message.Message):
    __slots__ = ("lease_id", "prompt_token_ids", "max_blocks", "lora_salt")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    LORA_SALT_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    max_blocks: int
    lora_salt: str
    def __init__(self, lease_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., max_blocks: _Optional[int] = ..., lora_salt: _Optional[str] = ...) -> None: ...

class LendResponse(_message.Message):
    __slots__ = ("tier", "slots", "checksums", "lease_s")
    TIER_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    CHECKSUMS_FIELD_NUMBER: _ClassVar[int]
    LEASE_S_FIELD_NUMBER: _ClassVar[int]
    tier: KVTransferInfo
    slots: _containers.RepeatedScalarFieldContainer[int]
    checksums: _containers.RepeatedScalarFieldContainer[int]
    lease_s: float
    def __init__(self, tier: _Optional[_Union[KVTransferInfo, _Mapping]] = ..., slots: _Optional[_Iterable[int]] = ..., checksums: _Optional[_Iterable[int]] = ..., lease_s: _Optional[float] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("handle", "prompt_logprobs", "timing", "finished")
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TIMING_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    handle: KVHandle
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprobs]
    timing: HopTiming
    finished: Finished
    def __init__(self, handle: _Optional[_Union[KVHandle, _Mapping]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[TokenLogprobs, _Mapping]]] = ..., timing: _Optional[_Union[HopTiming, _Mapping]] = ..., finished: _Optional[_Union[Finished, _Mapping]] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("request_id", "epoch")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    epoch: int
    def __init__(self, request_id: _Optional[str] = ..., epoch: _Optional[int] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: bool
    def __init__(self, released: _Optional[bool] = ...) -> None: ...

class DecodeRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "params", "priority", "handle", "kv_source", "peer")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    KV_SOURCE_FIELD_NUMBER: _ClassVar[int]
    PEER_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    params: SamplingParams
    priority: int
    handle: KVHandle
    kv_source: str
    peer: PeerPrefix
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., params: _Optional[_Union[SamplingParams, _Mapping]] = ..., priority: _Optional[int] = ..., handle: _Optional[_Union[KVHandle, _Mapping]] = ..., kv_source: _Optional[str] = ..., peer: _Optional[_Union[PeerPrefix, _Mapping]] = ...) -> None: ...

class WatchKVRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class KVProgress(_message.Message):
    __slots__ = ("handle", "complete")
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    COMPLETE_FIELD_NUMBER: _ClassVar[int]
    handle: KVHandle
    complete: bool
    def __init__(self, handle: _Optional[_Union[KVHandle, _Mapping]] = ..., complete: _Optional[bool] = ...) -> None: ...

class ProvideKVRequest(_message.Message):
    __slots__ = ("request_id", "handle")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    handle: KVHandle
    def __init__(self, request_id: _Optional[str] = ..., handle: _Optional[_Union[KVHandle, _Mapping]] = ...) -> None: ...

class ProvideKVResponse(_message.Message):
    __slots__ = ("accepted",)
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    accepted: bool
    def __init__(self, accepted: _Optional[bool] = ...) -> None: ...

class TokenChunk(_message.Message):
    __slots__ = ("sample_index", "token_ids", "logprobs", "prompt_logprobs", "cached_tokens")
    SAMPLE_INDEX_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    sample_index: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprobs]
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprobs]
    cached_tokens: int
    def __init__(self, sample_index: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprobs, _Mapping]]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[TokenLogprobs, _Mapping]]] = ..., cached_tokens: _Optional[int] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "cached_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ...) -> None: ...

class Finished(_message.Message):
    __slots__ = ("sample_index", "finish_reason", "stop_reason", "usage", "timing", "stop_token_id")
    SAMPLE_INDEX_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STOP_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    TIMING_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    sample_index: int
    finish_reason: str
    stop_reason: str
    usage: Usage
    timing: HopTiming
    stop_token_id: int
    def __init__(self, sample_index: _Optional[int] = ..., finish_reason: _Optional[str] = ..., stop_reason: _Optional[str] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., timing: _Optional[_Union[HopTiming, _Mapping]] = ..., stop_token_id: _Optional[int] = ...) -> None: ...

class HopTiming(_message.Message):
    __slots__ = ("route_ms", "router_ms", "prefill_call_ms", "decode_call_ms", "prefill_queue_ms", "prefill_compute_ms", "kv_transfer_ms", "decode_queue_ms", "decode_first_step_ms")
    ROUTE_MS_FIELD_NUMBER: _ClassVar[int]
    ROUTER_MS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_CALL_MS_FIELD_NUMBER: _ClassVar[int]
    DECODE_CALL_MS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_QUEUE_MS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_COMPUTE_MS_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_MS_FIELD_NUMBER: _ClassVar[int]
    DECODE_QUEUE_MS_FIELD_NUMBER: _ClassVar[int]
    DECODE_FIRST_STEP_MS_FIELD_NUMBER: _ClassVar[int]
    route_ms: float
    router_ms: float
    prefill_call_ms: float
    decode_call_ms: float
    prefill_queue_ms: float
    prefill_compute_ms: float
    kv_transfer_ms: float
    decode_queue_ms: float
    decode_first_step_ms: float
    def __init__(self, route_ms: _Optional[float] = ..., router_ms: _Optional[float] = ..., prefill_call_ms: _Optional[float] = ..., decode_call_ms: _Optional[float] = ..., prefill_queue_ms: _Optional[float] = ..., prefill_compute_ms: _Optional[float] = ..., kv_transfer_ms: _Optional[float] = ..., decode_queue_ms: _Optional[float] = ..., decode_first_step_ms: _Optional[float] = ...) -> None: ...

class StreamError(_message.Message):
    __slots__ = ("code", "message")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    code: str
    message: str
    def __init__(self, code: _Optional[str] = ..., message: _Optional[str] = ...) -> None: ...

class Progress(_message.Message):
    __slots__ = ("step_ms", "blocked_ms", "interval_ms")
    STEP_MS_FIELD_NUMBER: _ClassVar[int]
    BLOCKED_MS_FIELD_NUMBER: _ClassVar[int]
    INTERVAL_MS_FIELD_NUMBER: _ClassVar[int]
    step_ms: float
    blocked_ms: float
    interval_ms: float
    def __init__(self, step_ms: _Optional[float] = ..., blocked_ms: _Optional[float] = ..., interval_ms: _Optional[float] = ...) -> None: ...

class RouteInfo(_message.Message):
    __slots__ = ("prefill_worker", "decode_worker", "predicted_hit_tokens", "delivered_hit_tokens", "peer_worker")
    PREFILL_WORKER_FIELD_NUMBER: _ClassVar[int]
    DECODE_WORKER_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DELIVERED_HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PEER_WORKER_FIELD_NUMBER: _ClassVar[int]
    prefill_worker: str
    decode_worker: str
    predicted_hit_tokens: int
    delivered_hit_tokens: int
    peer_worker: str
    def __init__(self, prefill_worker: _Optional[str] = ..., decode_worker: _Optional[str] = ..., predicted_hit_tokens: _Optional[int] = ..., delivered_hit_tokens: _Optional[int] = ..., peer_worker: _Optional[str] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("tokens", "finished", "error", "route", "progress")
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    ROUTE_FIELD_NUMBER: _ClassVar[int]
    PROGRESS_FIELD_NUMBER: _ClassVar[int]
    tokens: TokenChunk
    finished: Finished
    error: StreamError
    route: RouteInfo
    progress: Progress
    def __init__(self, tokens: _Optional[_Union[TokenChunk, _Mapping]] = ..., finished: _Optional[_Union[Finished, _Mapping]] = ..., error: _Optional[_Union[StreamError, _Mapping]] = ..., route: _Optional[_Union[RouteInfo, _Mapping]] = ..., progress: _Optional[_Union[Progress, _Mapping]] = ...) -> None: ...

class CallStreamRequest(_message.Message):
    __slots__ = ("call_id", "decode", "generate", "cancel", "prefill", "timeout_s")
    CALL_ID_FIELD_NUMBER: _ClassVar[int]
    DECODE_FIELD_NUMBER: _ClassVar[int]
    GENERATE_FIELD_NUMBER: _ClassVar[int]
    CANCEL_FIELD_NUMBER: _ClassVar[int]
    PREFILL_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    call_id: int
    decode: DecodeRequest
    generate: GenerateRequest
    cancel: bool
    prefill: PrefillRequest
    timeout_s: float
    def __init__(self, call_id: _Optional[int] = ..., decode: _Optional[_Union[DecodeRequest, _Mapping]] = ..., generate: _Optional[_Union[GenerateRequest, _Mapping]] = ..., cancel: _Optional[bool] = ..., prefill: _Optional[_Union[PrefillRequest, _Mapping]] = ..., timeout_s: _Optional[float] = ...) -> None: ...

class CallStreamRequestBatch(_message.Message):
    __slots__ = ("requests",)
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    requests: _containers.RepeatedCompositeFieldContainer[CallStreamRequest]
    def __init__(self, requests: _Optional[_Iterable[_Union[CallStreamRequest, _Mapping]]] = ...) -> None: ...

class CallEnd(_message.Message):
    __slots__ = ("code", "details")
    CODE_FIELD_NUMBER: _ClassVar[int]
    DETAILS_FIELD_NUMBER: _ClassVar[int]
    code: int
    details: str
    def __init__(self, code: _Optional[int] = ..., details: _Optional[str] = ...) -> None: ...

class CallStreamItem(_message.Message):
    __slots__ = ("call_id", "message", "end", "prefill")
    CALL_ID_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    PREFILL_FIELD_NUMBER: _ClassVar[int]
    call_id: int
    message: GenerateResponse
    end: CallEnd
    prefill: PrefillResponse
    def __init__(self, call_id: _Optional[int] = ..., message: _Optional[_Union[GenerateResponse, _Mapping]] = ..., end: _Optional[_Union[CallEnd, _Mapping]] = ..., prefill: _Optional[_Union[PrefillResponse, _Mapping]] = ...) -> None: ...

class CallStreamBatch(_message.Message):
    __slots__ = ("items",)
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[CallStreamItem]
    def __init__(self, items: _Optional[_Iterable[_Union[CallStreamItem, _Mapping]]] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ("aborted",)
    ABORTED_FIELD_NUMBER: _ClassVar[int]
    aborted: bool
    def __init__(self, aborted: _Optional[bool] = ...) -> None: ...

class KVLayoutInfo(_message.Message):
    __slots__ = ("num_layers", "block_size", "num_kv_heads", "head_dim", "dtype", "model", "layout")
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    model: str
    layout: str
    def __init__(self, num_layers: _Optional[int] = ..., block_size: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., dtype: _Optional[str] = ..., model: _Optional[str] = ..., layout: _Optional[str] = ...) -> None: ...

class KVTransferInfo(_message.Message):
    __slots__ = ("agent_name", "agent_metadata", "base_addr", "block_bytes", "num_blocks", "compat_hash", "layout", "memory_type", "device_id")
    AGENT_NAME_FIELD_NUMBER: _ClassVar[int]
    AGENT_METADATA_FIELD_NUMBER: _ClassVar[int]
    BASE_ADDR_FIELD_NUMBER: _ClassVar[int]
    BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    COMPAT_HASH_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    MEMORY_TYPE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_ID_FIELD_NUMBER: _ClassVar[int]
    agent_name: str
    agent_metadata: bytes
    base_addr: int
    block_bytes: int
    num_blocks: int
    compat_hash: str
    layout: KVLayoutInfo
    memory_type: str
    device_id: int
    def __init__(self, agent_name: _Optional[str] = ..., agent_metadata: _Optional[bytes] = ..., base_addr: _Optional[int] = ..., block_bytes: _Optional[int] = ..., num_blocks: _Optional[int] = ..., compat_hash: _Optional[str] = ..., layout: _Optional[_Union[KVLayoutInfo, _Mapping]] = ..., memory_type: _Optional[str] = ..., device_id: _Optional[int] = ...) -> None: ...

class EngineStats(_message.Message):
    __slots__ = ("num_running", "num_waiting", "num_swapped", "num_blocks", "num_free_blocks", "kv_usage", "prefix_cache_queries", "prefix_cache_hits", "num_preemptions", "prompt_tokens", "generation_tokens", "num_held_requests", "num_transferring", "spec_num_drafts", "spec_draft_tokens", "spec_accepted_tokens", "spec_accepted_per_position", "prefix_cache_hits_host", "host_cache_blocks", "host_cache_used", "host_offloaded_blocks", "num_steps", "num_graph_steps", "prefix_cache_hits_disk", "disk_cache_blocks", "disk_cache_used", "disk_written_blocks", "disk_rejected_blocks", "peer_received_blocks", "peer_lent_blocks", "peer_rejected_blocks")
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    NUM_SWAPPED_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    KV_USAGE_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_QUERIES_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_HITS_FIELD_NUMBER: _ClassVar[int]
    NUM_PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    GENERATION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_HELD_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    NUM_TRANSFERRING_FIELD_NUMBER: _ClassVar[int]
    SPEC_NUM_DRAFTS_FIELD_NUMBER: _ClassVar[int]
    SPEC_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SPEC_ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SPEC_ACCEPTED_PER_POSITION_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_HITS_HOST_FIELD_NUMBER: _ClassVar[int]
    HOST_CACHE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    HOST_CACHE_USED_FIELD_NUMBER: _ClassVar[int]
    HOST_OFFLOADED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_STEPS_FIELD_NUMBER: _ClassVar[int]
    NUM_GRAPH_STEPS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_HITS_DISK_FIELD_NUMBER: _ClassVar[int]
    DISK_CACHE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    DISK_CACHE_USED_FIELD_NUMBER: _ClassVar[int]
    DISK_WRITTEN_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    DISK_REJECTED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PEER_RECEIVED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PEER_LENT_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PEER_REJECTED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    num_running: int
    num_waiting: int
    num_swapped: int
    num_blocks: int
    num_free_blocks: int
    kv_usage: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    prompt_tokens: int
    generation_tokens: int
    num_held_requests: int
    num_transferring: int
    spec_num_drafts: int
    spec_draft_tokens: int
    spec_accepted_tokens: int
    spec_accepted_per_position: _containers.RepeatedScalarFieldContainer[int]
    prefix_cache_hits_host: int
    host_cache_blocks: int
    host_cache_used: int
    host_offloaded_blocks: int
    num_steps: int
    num_graph_steps: int
    prefix_cache_hits_disk: int
    disk_cache_blocks: int
    disk_cache_used: int
    disk_written_blocks: int
    disk_rejected_blocks: int
    peer_received_blocks: int
    peer_lent_blocks: int
    peer_rejected_blocks: int
    def __init__(self, num_running: _Optional[int] = ..., num_waiting: _Optional[int] = ..., num_swapped: _Optional[int] = ..., num_blocks: _Optional[int] = ..., num_free_blocks: _Optional[int] = ..., kv_usage: _Optional[float] = ..., prefix_cache_queries: _Optional[int] = ..., prefix_cache_hits: _Optional[int] = ..., num_preemptions: _Optional[int] = ..., prompt_tokens: _Optional[int] = ..., generation_tokens: _Optional[int] = ..., num_held_requests: _Optional[int] = ..., num_transferring: _Optional[int] = ..., spec_num_drafts: _Optional[int] = ..., spec_draft_tokens: _Optional[int] = ..., spec_accepted_tokens: _Optional[int] = ..., spec_accepted_per_position: _Optional[_Iterable[int]] = ..., prefix_cache_hits_host: _Optional[int] = ..., host_cache_blocks: _Optional[int] = ..., host_cache_used: _Optional[int] = ..., host_offloaded_blocks: _Optional[int] = ..., num_steps: _Optional[int] = ..., num_graph_steps: _Optional[int] = ..., prefix_cache_hits_disk: _Optional[int] = ..., disk_cache_blocks: _Optional[int] = ..., disk_cache_used: _Optional[int] = ..., disk_written_blocks: _Optional[int] = ..., disk_rejected_blocks: _Optional[int] = ..., peer_received_blocks: _Optional[int] = ..., peer_lent_blocks: _Optional[int] = ..., peer_rejected_blocks: _Optional[int] = ...) -> None: ...

class KVTransferStats(_message.Message):
    __slots__ = ("bytes", "completed", "failures", "recomputed", "seconds_sum", "bucket_bounds", "bucket_counts", "waited", "descriptors", "expired_leases", "streamed", "streamed_bytes")
    BYTES_FIELD_NUMBER: _ClassVar[int]
    COMPLETED_FIELD_NUMBER: _ClassVar[int]
    FAILURES_FIELD_NUMBER: _ClassVar[int]
    RECOMPUTED_FIELD_NUMBER: _ClassVar[int]
    SECONDS_SUM_FIELD_NUMBER: _ClassVar[int]
    BUCKET_BOUNDS_FIELD_NUMBER: _ClassVar[int]
    BUCKET_COUNTS_FIELD_NUMBER: _ClassVar[int]
    WAITED_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTORS_FIELD_NUMBER: _ClassVar[int]
    EXPIRED_LEASES_FIELD_NUMBER: _ClassVar[int]
    STREAMED_FIELD_NUMBER: _ClassVar[int]
    STREAMED_BYTES_FIELD_NUMBER: _ClassVar[int]
    bytes: int
    completed: int
    failures: int
    recomputed: int
    seconds_sum: float
    bucket_bounds: _containers.RepeatedScalarFieldContainer[float]
    bucket_counts: _containers.RepeatedScalarFieldContainer[int]
    waited: int
    descriptors: int
    expired_leases: int
    streamed: int
    streamed_bytes: int
    def __init__(self, bytes: _Optional[int] = ..., completed: _Optional[int] = ..., failures: _Optional[int] = ..., recomputed: _Optional[int] = ..., seconds_sum: _Optional[float] = ..., bucket_bounds: _Optional[_Iterable[float]] = ..., bucket_counts: _Optional[_Iterable[int]] = ..., waited: _Optional[int] = ..., descriptors: _Optional[int] = ..., expired_leases: _Optional[int] = ..., streamed: _Optional[int] = ..., streamed_bytes: _Optional[int] = ...) -> None: ...

class GetStateRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerState(_message.Message):
    __slots__ = ("worker_id", "epoch", "role", "address", "transfer", "stats", "model", "max_model_len", "vocab_size", "cache_salt", "transfer_stats", "pid", "draining")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_STATS_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    epoch: int
    role: str
    address: str
    transfer: KVTransferInfo
    stats: EngineStats
    model: str
    max_model_len: int
    vocab_size: int
    cache_salt: str
    transfer_stats: KVTransferStats
    pid: int
    draining: bool
    def __init__(self, worker_id: _Optional[str] = ..., epoch: _Optional[int] = ..., role: _Optional[str] = ..., address: _Optional[str] = ..., transfer: _Optional[_Union[KVTransferInfo, _Mapping]] = ..., stats: _Optional[_Union[EngineStats, _Mapping]] = ..., model: _Optional[str] = ..., max_model_len: _Optional[int] = ..., vocab_size: _Optional[int] = ..., cache_salt: _Optional[str] = ..., transfer_stats: _Optional[_Union[KVTransferStats, _Mapping]] = ..., pid: _Optional[int] = ..., draining: _Optional[bool] = ...) -> None: ...

class AdapterRequest(_message.Message):
    __slots__ = ("name", "path", "unload", "replace", "check")
    NAME_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    UNLOAD_FIELD_NUMBER: _ClassVar[int]
    REPLACE_FIELD_NUMBER: _ClassVar[int]
    CHECK_FIELD_NUMBER: _ClassVar[int]
    name: str
    path: str
    unload: bool
    replace: bool
    check: bool
    def __init__(self, name: _Optional[str] = ..., path: _Optional[str] = ..., unload: _Optional[bool] = ..., replace: _Optional[bool] = ..., check: _Optional[bool] = ...) -> None: ...

class AdapterResponse(_message.Message):
    __slots__ = ("loras", "workers")
    class LorasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    LORAS_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    loras: _containers.ScalarMap[str, str]
    workers: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, loras: _Optional[_Mapping[str, str]] = ..., workers: _Optional[_Iterable[str]] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "params", "priority")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    params: SamplingParams
    priority: int
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., params: _Optional[_Union[SamplingParams, _Mapping]] = ..., priority: _Optional[int] = ...) -> None: ...

class WorkerSummary(_message.Message):
    __slots__ = ("state", "healthy", "queued_prompt_tokens")
    STATE_FIELD_NUMBER: _ClassVar[int]
    HEALTHY_FIELD_NUMBER: _ClassVar[int]
    QUEUED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    state: WorkerState
    healthy: bool
    queued_prompt_tokens: int
    def __init__(self, state: _Optional[_Union[WorkerState, _Mapping]] = ..., healthy: _Optional[bool] = ..., queued_prompt_tokens: _Optional[int] = ...) -> None: ...

class ClusterStateRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RoutingCount(_message.Message):
    __slots__ = ("role", "worker_id", "requests")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    role: str
    worker_id: str
    requests: int
    def __init__(self, role: _Optional[str] = ..., worker_id: _Optional[str] = ..., requests: _Optional[int] = ...) -> None: ...

class ClusterState(_message.Message):
    __slots__ = ("workers", "degraded", "policy", "requests_routed", "predicted_prefix_hit_rate", "delivered_prefix_hit_rate", "index_entries", "event_lag_seconds", "events_applied", "gaps_detected", "resyncs", "decisions", "prefill_retries", "aggregated_fallbacks", "failed_requests", "active_requests", "draining", "decode_retries", "local_prefills", "hop_timing", "migrations", "stalls", "migrations_refused", "suspect_workers", "kv_streamed", "peer_reads", "indexed", "adapters", "failed_by_code", "call_streams", "router_id", "prompt_tokens", "predicted_hit_tokens", "delivered_hit_tokens")
    class FailedByCodeEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    DEGRADED_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_ROUTED_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_PREFIX_HIT_RATE_FIELD_NUMBER: _ClassVar[int]
    DELIVERED_PREFIX_HIT_RATE_FIELD_NUMBER: _ClassVar[int]
    INDEX_ENTRIES_FIELD_NUMBER: _ClassVar[int]
    EVENT_LAG_SECONDS_FIELD_NUMBER: _ClassVar[int]
    EVENTS_APPLIED_FIELD_NUMBER: _ClassVar[int]
    GAPS_DETECTED_FIELD_NUMBER: _ClassVar[int]
    RESYNCS_FIELD_NUMBER: _ClassVar[int]
    DECISIONS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_RETRIES_FIELD_NUMBER: _ClassVar[int]
    AGGREGATED_FALLBACKS_FIELD_NUMBER: _ClassVar[int]
    FAILED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    DECODE_RETRIES_FIELD_NUMBER: _ClassVar[int]
    LOCAL_PREFILLS_FIELD_NUMBER: _ClassVar[int]
    HOP_TIMING_FIELD_NUMBER: _ClassVar[int]
    MIGRATIONS_FIELD_NUMBER: _ClassVar[int]
    STALLS_FIELD_NUMBER: _ClassVar[int]
    MIGRATIONS_REFUSED_FIELD_NUMBER: _ClassVar[int]
    SUSPECT_WORKERS_FIELD_NUMBER: _ClassVar[int]
    KV_STREAMED_FIELD_NUMBER: _ClassVar[int]
    PEER_READS_FIELD_NUMBER: _ClassVar[int]
    INDEXED_FIELD_NUMBER: _ClassVar[int]
    ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    FAILED_BY_CODE_FIELD_NUMBER: _ClassVar[int]
    CALL_STREAMS_FIELD_NUMBER: _ClassVar[int]
    ROUTER_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DELIVERED_HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    workers: _containers.RepeatedCompositeFieldContainer[WorkerSummary]
    degraded: bool
    policy: str
    requests_routed: int
    predicted_prefix_hit_rate: float
    delivered_prefix_hit_rate: float
    index_entries: int
    event_lag_seconds: float
    events_applied: int
    gaps_detected: int
    resyncs: int
    decisions: _containers.RepeatedCompositeFieldContainer[RoutingCount]
    prefill_retries: int
    aggregated_fallbacks: int
    failed_requests: int
    active_requests: int
    draining: bool
    decode_retries: int
    local_prefills: int
    hop_timing: _containers.RepeatedCompositeFieldContainer[HopSummary]
    migrations: int
    stalls: int
    migrations_refused: int
    suspect_workers: _containers.RepeatedScalarFieldContainer[str]
    kv_streamed: int
    peer_reads: int
    indexed: _containers.RepeatedCompositeFieldContainer[IndexedWorker]
    adapters: _containers.RepeatedScalarFieldContainer[str]
    failed_by_code: _containers.ScalarMap[str, int]
    call_streams: str
    router_id: str
    prompt_tokens: int
    predicted_hit_tokens: int
    delivered_hit_tokens: int
    def __init__(self, workers: _Optional[_Iterable[_Union[WorkerSummary, _Mapping]]] = ..., degraded: _Optional[bool] = ..., policy: _Optional[str] = ..., requests_routed: _Optional[int] = ..., predicted_prefix_hit_rate: _Optional[float] = ..., delivered_prefix_hit_rate: _Optional[float] = ..., index_entries: _Optional[int] = ..., event_lag_seconds: _Optional[float] = ..., events_applied: _Optional[int] = ..., gaps_detected: _Optional[int] = ..., resyncs: _Optional[int] = ..., decisions: _Optional[_Iterable[_Union[RoutingCount, _Mapping]]] = ..., prefill_retries: _Optional[int] = ..., aggregated_fallbacks: _Optional[int] = ..., failed_requests: _Optional[int] = ..., active_requests: _Optional[int] = ..., draining: _Optional[bool] = ..., decode_retries: _Optional[int] = ..., local_prefills: _Optional[int] = ..., hop_timing: _Optional[_Iterable[_Union[HopSummary, _Mapping]]] = ..., migrations: _Optional[int] = ..., stalls: _Optional[int] = ..., migrations_refused: _Optional[int] = ..., suspect_workers: _Optional[_Iterable[str]] = ..., kv_streamed: _Optional[int] = ..., peer_reads: _Optional[int] = ..., indexed: _Optional[_Iterable[_Union[IndexedWorker, _Mapping]]] = ..., adapters: _Optional[_Iterable[str]] = ..., failed_by_code: _Optional[_Mapping[str, int]] = ..., call_streams: _Optional[str] = ..., router_id: _Optional[str] = ..., prompt_tokens: _Optional[int] = ..., predicted_hit_tokens: _Optional[int] = ..., delivered_hit_tokens: _Optional[int] = ...) -> None: ...

class IndexedWorker(_message.Message):
    __slots__ = ("worker_id", "epoch", "blocks", "host_blocks", "disk_blocks")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    HOST_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    DISK_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    epoch: int
    blocks: int
    host_blocks: int
    disk_blocks: int
    def __init__(self, worker_id: _Optional[str] = ..., epoch: _Optional[int] = ..., blocks: _Optional[int] = ..., host_blocks: _Optional[int] = ..., disk_blocks: _Optional[int] = ...) -> None: ...

class HopSummary(_message.Message):
    __slots__ = ("hop", "count", "mean_ms", "p50_ms", "p90_ms")
    HOP_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    MEAN_MS_FIELD_NUMBER: _ClassVar[int]
    P50_MS_FIELD_NUMBER: _ClassVar[int]
    P90_MS_FIELD_NUMBER: _ClassVar[int]
    hop: str
    count: int
    mean_ms: float
    p50_ms: float
    p90_ms: float
    def __init__(self, hop: _Optional[str] = ..., count: _Optional[int] = ..., mean_ms: _Optional[float] = ..., p50_ms: _Optional[float] = ..., p90_ms: _Optional[float] = ...) -> None: ...

class EngineCommand(_message.Message):
    __slots__ = ("command_id", "start", "add", "abort", "stats", "watch_kv", "snapshot", "stop", "add_peer", "remove_peer", "pull", "pull_early", "pull_extend", "pull_finish", "release", "watch", "unwatch", "lend", "fetch", "adapter")
    COMMAND_ID_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    ADD_FIELD_NUMBER: _ClassVar[int]
    ABORT_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    WATCH_KV_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    ADD_PEER_FIELD_NUMBER: _ClassVar[int]
    REMOVE_PEER_FIELD_NUMBER: _ClassVar[int]
    PULL_FIELD_NUMBER: _ClassVar[int]
    PULL_EARLY_FIELD_NUMBER: _ClassVar[int]
    PULL_EXTEND_FIELD_NUMBER: _ClassVar[int]
    PULL_FINISH_FIELD_NUMBER: _ClassVar[int]
    RELEASE_FIELD_NUMBER: _ClassVar[int]
    WATCH_FIELD_NUMBER: _ClassVar[int]
    UNWATCH_FIELD_NUMBER: _ClassVar[int]
    LEND_FIELD_NUMBER: _ClassVar[int]
    FETCH_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    command_id: int
    start: str
    add: EngineAdd
    abort: str
    stats: bool
    watch_kv: bool
    snapshot: bool
    stop: bool
    add_peer: KVTransferInfo
    remove_peer: str
    pull: EnginePull
    pull_early: EnginePull
    pull_extend: EngineExtend
    pull_finish: EnginePull
    release: str
    watch: EngineWatch
    unwatch: str
    lend: LendRequest
    fetch: EngineFetch
    adapter: AdapterRequest
    def __init__(self, command_id: _Optional[int] = ..., start: _Optional[str] = ..., add: _Optional[_Union[EngineAdd, _Mapping]] = ..., abort: _Optional[str] = ..., stats: _Optional[bool] = ..., watch_kv: _Optional[bool] = ..., snapshot: _Optional[bool] = ..., stop: _Optional[bool] = ..., add_peer: _Optional[_Union[KVTransferInfo, _Mapping]] = ..., remove_peer: _Optional[str] = ..., pull: _Optional[_Union[EnginePull, _Mapping]] = ..., pull_early: _Optional[_Union[EnginePull, _Mapping]] = ..., pull_extend: _Optional[_Union[EngineExtend, _Mapping]] = ..., pull_finish: _Optional[_Union[EnginePull, _Mapping]] = ..., release: _Optional[str] = ..., watch: _Optional[_Union[EngineWatch, _Mapping]] = ..., unwatch: _Optional[str] = ..., lend: _Optional[_Union[LendRequest, _Mapping]] = ..., fetch: _Optional[_Union[EngineFetch, _Mapping]] = ..., adapter: _Optional[_Union[AdapterRequest, _Mapping]] = ...) -> None: ...

class EngineFetch(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "lent", "lease_id", "asked_s", "lora_salt")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LENT_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    ASKED_S_FIELD_NUMBER: _ClassVar[int]
    LORA_SALT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    lent: LendResponse
    lease_id: str
    asked_s: float
    lora_salt: str
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., lent: _Optional[_Union[LendResponse, _Mapping]] = ..., lease_id: _Optional[str] = ..., asked_s: _Optional[float] = ..., lora_salt: _Optional[str] = ...) -> None: ...

class EngineWatch(_message.Message):
    __slots__ = ("request_id", "wait_s")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    WAIT_S_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    wait_s: float
    def __init__(self, request_id: _Optional[str] = ..., wait_s: _Optional[float] = ...) -> None: ...

class EngineExposed(_message.Message):
    __slots__ = ("request_id", "block_ids", "complete", "end")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    COMPLETE_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    complete: bool
    end: bool
    def __init__(self, request_id: _Optional[str] = ..., block_ids: _Optional[_Iterable[int]] = ..., complete: _Optional[bool] = ..., end: _Optional[bool] = ...) -> None: ...

class EngineLease(_message.Message):
    __slots__ = ("request_id", "expiry_unix")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    EXPIRY_UNIX_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    expiry_unix: float
    def __init__(self, request_id: _Optional[str] = ..., expiry_unix: _Optional[float] = ...) -> None: ...

class EnginePull(_message.Message):
    __slots__ = ("request", "handle", "policy", "reachable")
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    REACHABLE_FIELD_NUMBER: _ClassVar[int]
    request: EngineAdd
    handle: KVHandle
    policy: str
    reachable: bool
    def __init__(self, request: _Optional[_Union[EngineAdd, _Mapping]] = ..., handle: _Optional[_Union[KVHandle, _Mapping]] = ..., policy: _Optional[str] = ..., reachable: _Optional[bool] = ...) -> None: ...

class EngineExtend(_message.Message):
    __slots__ = ("request_id", "block_ids", "complete")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    COMPLETE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    complete: bool
    def __init__(self, request_id: _Optional[str] = ..., block_ids: _Optional[_Iterable[int]] = ..., complete: _Optional[bool] = ...) -> None: ...

class EngineCommands(_message.Message):
    __slots__ = ("commands",)
    COMMANDS_FIELD_NUMBER: _ClassVar[int]
    commands: _containers.RepeatedCompositeFieldContainer[EngineCommand]
    def __init__(self, commands: _Optional[_Iterable[_Union[EngineCommand, _Mapping]]] = ...) -> None: ...

class EngineAdd(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "params", "priority", "prefill_only")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    PREFILL_ONLY_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    params: SamplingParams
    priority: int
    prefill_only: bool
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., params: _Optional[_Union[SamplingParams, _Mapping]] = ..., priority: _Optional[int] = ..., prefill_only: _Optional[bool] = ...) -> None: ...

class KVEventBatch(_message.Message):
    __slots__ = ("kind", "hashes")
    KIND_FIELD_NUMBER: _ClassVar[int]
    HASHES_FIELD_NUMBER: _ClassVar[int]
    kind: str
    hashes: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, kind: _Optional[str] = ..., hashes: _Optional[_Iterable[bytes]] = ...) -> None: ...

class EngineLoad(_message.Message):
    __slots__ = ("num_running", "num_waiting", "num_free_blocks", "queued_prompt_tokens", "host_hit_cost_pct", "disk_hit_cost_pct", "peer_hit_cost_pct", "resident_loras")
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    NUM_FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    QUEUED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    HOST_HIT_COST_PCT_FIELD_NUMBER: _ClassVar[int]
    DISK_HIT_COST_PCT_FIELD_NUMBER: _ClassVar[int]
    PEER_HIT_COST_PCT_FIELD_NUMBER: _ClassVar[int]
    RESIDENT_LORAS_FIELD_NUMBER: _ClassVar[int]
    num_running: int
    num_waiting: int
    num_free_blocks: int
    queued_prompt_tokens: int
    host_hit_cost_pct: int
    disk_hit_cost_pct: int
    peer_hit_cost_pct: int
    resident_loras: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, num_running: _Optional[int] = ..., num_waiting: _Optional[int] = ..., num_free_blocks: _Optional[int] = ..., queued_prompt_tokens: _Optional[int] = ..., host_hit_cost_pct: _Optional[int] = ..., disk_hit_cost_pct: _Optional[int] = ..., peer_hit_cost_pct: _Optional[int] = ..., resident_loras: _Optional[_Iterable[str]] = ...) -> None: ...

class EngineReady(_message.Message):
    __slots__ = ("layout", "num_blocks", "max_model_len", "vocab_size", "max_num_seqs", "cache_salt", "pid", "transfer", "loras")
    class LorasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_SEQS_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_FIELD_NUMBER: _ClassVar[int]
    LORAS_FIELD_NUMBER: _ClassVar[int]
    layout: KVLayoutInfo
    num_blocks: int
    max_model_len: int
    vocab_size: int
    max_num_seqs: int
    cache_salt: str
    pid: int
    transfer: KVTransferInfo
    loras: _containers.ScalarMap[str, str]
    def __init__(self, layout: _Optional[_Union[KVLayoutInfo, _Mapping]] = ..., num_blocks: _Optional[int] = ..., max_model_len: _Optional[int] = ..., vocab_size: _Optional[int] = ..., max_num_seqs: _Optional[int] = ..., cache_salt: _Optional[str] = ..., pid: _Optional[int] = ..., transfer: _Optional[_Union[KVTransferInfo, _Mapping]] = ..., loras: _Optional[_Mapping[str, str]] = ...) -> None: ...

class EngineReply(_message.Message):
    __slots__ = ("command_id", "error", "error_type", "stats", "aborted", "ready", "cached_hashes", "started", "transfer_stats", "pending_pulls", "host_hashes", "released", "num_leases", "releases", "disk_hashes", "lent", "loras")
    class ReleasesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class LorasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    COMMAND_ID_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    ERROR_TYPE_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    ABORTED_FIELD_NUMBER: _ClassVar[int]
    READY_FIELD_NUMBER: _ClassVar[int]
    CACHED_HASHES_FIELD_NUMBER: _ClassVar[int]
    STARTED_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_STATS_FIELD_NUMBER: _ClassVar[int]
    PENDING_PULLS_FIELD_NUMBER: _ClassVar[int]
    HOST_HASHES_FIELD_NUMBER: _ClassVar[int]
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    NUM_LEASES_FIELD_NUMBER: _ClassVar[int]
    RELEASES_FIELD_NUMBER: _ClassVar[int]
    DISK_HASHES_FIELD_NUMBER: _ClassVar[int]
    LENT_FIELD_NUMBER: _ClassVar[int]
    LORAS_FIELD_NUMBER: _ClassVar[int]
    command_id: int
    error: str
    error_type: str
    stats: EngineStats
    aborted: bool
    ready: EngineReady
    cached_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    started: bool
    transfer_stats: KVTransferStats
    pending_pulls: int
    host_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    released: bool
    num_leases: int
    releases: _containers.ScalarMap[str, int]
    disk_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    lent: LendResponse
    loras: _containers.ScalarMap[str, str]
    def __init__(self, command_id: _Optional[int] = ..., error: _Optional[str] = ..., error_type: _Optional[str] = ..., stats: _Optional[_Union[EngineStats, _Mapping]] = ..., aborted: _Optional[bool] = ..., ready: _Optional[_Union[EngineReady, _Mapping]] = ..., cached_hashes: _Optional[_Iterable[bytes]] = ..., started: _Optional[bool] = ..., transfer_stats: _Optional[_Union[KVTransferStats, _Mapping]] = ..., pending_pulls: _Optional[int] = ..., host_hashes: _Optional[_Iterable[bytes]] = ..., released: _Optional[bool] = ..., num_leases: _Optional[int] = ..., releases: _Optional[_Mapping[str, int]] = ..., disk_hashes: _Optional[_Iterable[bytes]] = ..., lent: _Optional[_Union[LendResponse, _Mapping]] = ..., loras: _Optional[_Mapping[str, str]] = ...) -> None: ...

class EngineOutput(_message.Message):
    __slots__ = ("request_id", "sample_index", "token_ids", "logprobs", "has_logprobs", "finish_reason", "stop_string", "stop_token", "num_prompt_tokens", "num_cached_tokens", "error", "seed", "prompt_logprobs", "has_prompt_logprobs", "error_type", "held", "held_block_ids")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_INDEX_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    HAS_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STOP_STRING_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    HAS_PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    ERROR_TYPE_FIELD_NUMBER: _ClassVar[int]
    HELD_FIELD_NUMBER: _ClassVar[int]
    HELD_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    sample_index: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprobs]
    has_logprobs: bool
    finish_reason: str
    stop_string: str
    stop_token: int
    num_prompt_tokens: int
    num_cached_tokens: int
    error: str
    seed: int
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprobs]
    has_prompt_logprobs: bool
    error_type: str
    held: bool
    held_block_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, request_id: _Optional[str] = ..., sample_index: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprobs, _Mapping]]] = ..., has_logprobs: _Optional[bool] = ..., finish_reason: _Optional[str] = ..., stop_string: _Optional[str] = ..., stop_token: _Optional[int] = ..., num_prompt_tokens: _Optional[int] = ..., num_cached_tokens: _Optional[int] = ..., error: _Optional[str] = ..., seed: _Optional[int] = ..., prompt_logprobs: _Optional[_Iterable[_Union[TokenLogprobs, _Mapping]]] = ..., has_prompt_logprobs: _Optional[bool] = ..., error_type: _Optional[str] = ..., held: _Optional[bool] = ..., held_block_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class EngineTokens(_message.Message):
    __slots__ = ("request_ids", "sample_index", "num_tokens", "token_ids", "num_prompt_tokens", "num_cached_tokens", "batch", "batch_members", "batch_tokens")
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_INDEX_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BATCH_FIELD_NUMBER: _ClassVar[int]
    BATCH_MEMBERS_FIELD_NUMBER: _ClassVar[int]
    BATCH_TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_ids: _containers.RepeatedScalarFieldContainer[str]
    sample_index: _containers.RepeatedScalarFieldContainer[int]
    num_tokens: _containers.RepeatedScalarFieldContainer[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    num_prompt_tokens: _containers.RepeatedScalarFieldContainer[int]
    num_cached_tokens: _containers.RepeatedScalarFieldContainer[int]
    batch: int
    batch_members: SteadyBatch
    batch_tokens: bytes
    def __init__(self, request_ids: _Optional[_Iterable[str]] = ..., sample_index: _Optional[_Iterable[int]] = ..., num_tokens: _Optional[_Iterable[int]] = ..., token_ids: _Optional[_Iterable[int]] = ..., num_prompt_tokens: _Optional[_Iterable[int]] = ..., num_cached_tokens: _Optional[_Iterable[int]] = ..., batch: _Optional[int] = ..., batch_members: _Optional[_Union[SteadyBatch, _Mapping]] = ..., batch_tokens: _Optional[bytes] = ...) -> None: ...

class SteadyBatch(_message.Message):
    __slots__ = ("request_ids", "sample_index", "num_prompt_tokens", "num_cached_tokens")
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_INDEX_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_ids: _containers.RepeatedScalarFieldContainer[str]
    sample_index: _containers.RepeatedScalarFieldContainer[int]
    num_prompt_tokens: _containers.RepeatedScalarFieldContainer[int]
    num_cached_tokens: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, request_ids: _Optional[_Iterable[str]] = ..., sample_index: _Optional[_Iterable[int]] = ..., num_prompt_tokens: _Optional[_Iterable[int]] = ..., num_cached_tokens: _Optional[_Iterable[int]] = ...) -> None: ...

class EngineEvents(_message.Message):
    __slots__ = ("replies", "outputs", "tokens", "step_started", "failure", "kv_events", "load", "landed", "leases", "exposed", "fetched", "output_positions")
    REPLIES_FIELD_NUMBER: _ClassVar[int]
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    STEP_STARTED_FIELD_NUMBER: _ClassVar[int]
    FAILURE_FIELD_NUMBER: _ClassVar[int]
    KV_EVENTS_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    LANDED_FIELD_NUMBER: _ClassVar[int]
    LEASES_FIELD_NUMBER: _ClassVar[int]
    EXPOSED_FIELD_NUMBER: _ClassVar[int]
    FETCHED_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_POSITIONS_FIELD_NUMBER: _ClassVar[int]
    replies: _containers.RepeatedCompositeFieldContainer[EngineReply]
    outputs: _containers.RepeatedCompositeFieldContainer[EngineOutput]
    tokens: EngineTokens
    step_started: float
    failure: str
    kv_events: _containers.RepeatedCompositeFieldContainer[KVEventBatch]
    load: EngineLoad
    landed: _containers.RepeatedCompositeFieldContainer[KVLanded]
    leases: _containers.RepeatedCompositeFieldContainer[EngineLease]
    exposed: _containers.RepeatedCompositeFieldContainer[EngineExposed]
    fetched: _containers.RepeatedScalarFieldContainer[str]
    output_positions: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, replies: _Optional[_Iterable[_Union[EngineReply, _Mapping]]] = ..., outputs: _Optional[_Iterable[_Union[EngineOutput, _Mapping]]] = ..., tokens: _Optional[_Union[EngineTokens, _Mapping]] = ..., step_started: _Optional[float] = ..., failure: _Optional[str] = ..., kv_events: _Optional[_Iterable[_Union[KVEventBatch, _Mapping]]] = ..., load: _Optional[_Union[EngineLoad, _Mapping]] = ..., landed: _Optional[_Iterable[_Union[KVLanded, _Mapping]]] = ..., leases: _Optional[_Iterable[_Union[EngineLease, _Mapping]]] = ..., exposed: _Optional[_Iterable[_Union[EngineExposed, _Mapping]]] = ..., fetched: _Optional[_Iterable[str]] = ..., output_positions: _Optional[_Iterable[int]] = ...) -> None: ...

class KVLanded(_message.Message):
    __slots__ = ("request_id", "seconds", "at")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    AT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    seconds: float
    at: float
    def __init__(self, request_id: _Optional[str] = ..., seconds: _Optional[float] = ..., at: _Optional[float] = ...) -> None: ...
