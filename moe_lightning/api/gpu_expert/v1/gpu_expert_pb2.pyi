from moe_lightning.api.common.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class StepKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    STEP_KIND_UNSPECIFIED: _ClassVar[StepKind]
    STEP_KIND_PREFILL: _ClassVar[StepKind]
    STEP_KIND_DECODE: _ClassVar[StepKind]
    STEP_KIND_MIXED: _ClassVar[StepKind]

class Side(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SIDE_UNSPECIFIED: _ClassVar[Side]
    SIDE_HOST: _ClassVar[Side]
    SIDE_DEVICE: _ClassVar[Side]
STEP_KIND_UNSPECIFIED: StepKind
STEP_KIND_PREFILL: StepKind
STEP_KIND_DECODE: StepKind
STEP_KIND_MIXED: StepKind
SIDE_UNSPECIFIED: Side
SIDE_HOST: Side
SIDE_DEVICE: Side

class DescribeRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DescribeResponse(_message.Message):
    __slots__ = ("device", "weight_bytes", "device_memory_bytes", "output_channel", "measurements", "device_kv_blocks", "device_kv_block_size", "resident_experts", "expert_ring_slots", "max_handoff_tokens", "tensor_parallel_ranks")
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_BYTES_FIELD_NUMBER: _ClassVar[int]
    DEVICE_MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_CHANNEL_FIELD_NUMBER: _ClassVar[int]
    MEASUREMENTS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_KV_BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    RESIDENT_EXPERTS_FIELD_NUMBER: _ClassVar[int]
    EXPERT_RING_SLOTS_FIELD_NUMBER: _ClassVar[int]
    MAX_HANDOFF_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TENSOR_PARALLEL_RANKS_FIELD_NUMBER: _ClassVar[int]
    device: str
    weight_bytes: int
    device_memory_bytes: int
    output_channel: str
    measurements: _common_pb2.HardwareMeasurements
    device_kv_blocks: int
    device_kv_block_size: int
    resident_experts: int
    expert_ring_slots: int
    max_handoff_tokens: int
    tensor_parallel_ranks: int
    def __init__(self, device: _Optional[str] = ..., weight_bytes: _Optional[int] = ..., device_memory_bytes: _Optional[int] = ..., output_channel: _Optional[str] = ..., measurements: _Optional[_Union[_common_pb2.HardwareMeasurements, _Mapping]] = ..., device_kv_blocks: _Optional[int] = ..., device_kv_block_size: _Optional[int] = ..., resident_experts: _Optional[int] = ..., expert_ring_slots: _Optional[int] = ..., max_handoff_tokens: _Optional[int] = ..., tensor_parallel_ranks: _Optional[int] = ...) -> None: ...

class ConnectRequest(_message.Message):
    __slots__ = ("input_channel", "session")
    INPUT_CHANNEL_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    input_channel: str
    session: int
    def __init__(self, input_channel: _Optional[str] = ..., session: _Optional[int] = ...) -> None: ...

class ConnectResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SequenceInput(_message.Message):
    __slots__ = ("seq_id", "token_ids", "start_position", "sampling", "draws", "prompt_length", "token_mask", "mask_follows")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    START_POSITION_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    DRAWS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    TOKEN_MASK_FIELD_NUMBER: _ClassVar[int]
    MASK_FOLLOWS_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    start_position: int
    sampling: _common_pb2.SamplingParams
    draws: int
    prompt_length: int
    token_mask: bytes
    mask_follows: bool
    def __init__(self, seq_id: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., start_position: _Optional[int] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., draws: _Optional[int] = ..., prompt_length: _Optional[int] = ..., token_mask: _Optional[bytes] = ..., mask_follows: _Optional[bool] = ...) -> None: ...

class MicroBatch(_message.Message):
    __slots__ = ("sequences",)
    SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    sequences: _containers.RepeatedCompositeFieldContainer[SequenceInput]
    def __init__(self, sequences: _Optional[_Iterable[_Union[SequenceInput, _Mapping]]] = ...) -> None: ...

class Placement(_message.Message):
    __slots__ = ("attention", "experts")
    ATTENTION_FIELD_NUMBER: _ClassVar[int]
    EXPERTS_FIELD_NUMBER: _ClassVar[int]
    attention: Side
    experts: Side
    def __init__(self, attention: _Optional[_Union[Side, str]] = ..., experts: _Optional[_Union[Side, str]] = ...) -> None: ...

class StepRequest(_message.Message):
    __slots__ = ("step_id", "micro_batches", "release_seq_ids", "placement", "kind", "expert_groups", "decodes")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    MICRO_BATCHES_FIELD_NUMBER: _ClassVar[int]
    RELEASE_SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    PLACEMENT_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    EXPERT_GROUPS_FIELD_NUMBER: _ClassVar[int]
    DECODES_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    micro_batches: _containers.RepeatedCompositeFieldContainer[MicroBatch]
    release_seq_ids: _containers.RepeatedScalarFieldContainer[int]
    placement: Placement
    kind: StepKind
    expert_groups: int
    decodes: int
    def __init__(self, step_id: _Optional[int] = ..., micro_batches: _Optional[_Iterable[_Union[MicroBatch, _Mapping]]] = ..., release_seq_ids: _Optional[_Iterable[int]] = ..., placement: _Optional[_Union[Placement, _Mapping]] = ..., kind: _Optional[_Union[StepKind, str]] = ..., expert_groups: _Optional[int] = ..., decodes: _Optional[int] = ...) -> None: ...

class StepMask(_message.Message):
    __slots__ = ("seq_id", "token_mask")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_MASK_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    token_mask: bytes
    def __init__(self, seq_id: _Optional[int] = ..., token_mask: _Optional[bytes] = ...) -> None: ...

class SetStepMasksRequest(_message.Message):
    __slots__ = ("step_id", "masks")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    MASKS_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    masks: _containers.RepeatedCompositeFieldContainer[StepMask]
    def __init__(self, step_id: _Optional[int] = ..., masks: _Optional[_Iterable[_Union[StepMask, _Mapping]]] = ...) -> None: ...

class SetStepMasksResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StepTimings(_message.Message):
    __slots__ = ("kind", "pre_attention_ns", "post_attention_ns", "head_ns", "attention_wait_ns", "handoff_send_ns", "expert_wait_ns", "device_attention_ns", "step_ns", "handler_ns", "collectives_ns", "attention_busy_ns", "link_busy_ns", "decode_ns")
    KIND_FIELD_NUMBER: _ClassVar[int]
    PRE_ATTENTION_NS_FIELD_NUMBER: _ClassVar[int]
    POST_ATTENTION_NS_FIELD_NUMBER: _ClassVar[int]
    HEAD_NS_FIELD_NUMBER: _ClassVar[int]
    ATTENTION_WAIT_NS_FIELD_NUMBER: _ClassVar[int]
    HANDOFF_SEND_NS_FIELD_NUMBER: _ClassVar[int]
    EXPERT_WAIT_NS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_ATTENTION_NS_FIELD_NUMBER: _ClassVar[int]
    STEP_NS_FIELD_NUMBER: _ClassVar[int]
    HANDLER_NS_FIELD_NUMBER: _ClassVar[int]
    COLLECTIVES_NS_FIELD_NUMBER: _ClassVar[int]
    ATTENTION_BUSY_NS_FIELD_NUMBER: _ClassVar[int]
    LINK_BUSY_NS_FIELD_NUMBER: _ClassVar[int]
    DECODE_NS_FIELD_NUMBER: _ClassVar[int]
    kind: StepKind
    pre_attention_ns: int
    post_attention_ns: int
    head_ns: int
    attention_wait_ns: int
    handoff_send_ns: int
    expert_wait_ns: int
    device_attention_ns: int
    step_ns: int
    handler_ns: int
    collectives_ns: int
    attention_busy_ns: int
    link_busy_ns: int
    decode_ns: int
    def __init__(self, kind: _Optional[_Union[StepKind, str]] = ..., pre_attention_ns: _Optional[int] = ..., post_attention_ns: _Optional[int] = ..., head_ns: _Optional[int] = ..., attention_wait_ns: _Optional[int] = ..., handoff_send_ns: _Optional[int] = ..., expert_wait_ns: _Optional[int] = ..., device_attention_ns: _Optional[int] = ..., step_ns: _Optional[int] = ..., handler_ns: _Optional[int] = ..., collectives_ns: _Optional[int] = ..., attention_busy_ns: _Optional[int] = ..., link_busy_ns: _Optional[int] = ..., decode_ns: _Optional[int] = ...) -> None: ...

class RankStep(_message.Message):
    __slots__ = ("rank", "bytes_streamed", "expert_wait_ns", "collectives_ns", "step_ns")
    RANK_FIELD_NUMBER: _ClassVar[int]
    BYTES_STREAMED_FIELD_NUMBER: _ClassVar[int]
    EXPERT_WAIT_NS_FIELD_NUMBER: _ClassVar[int]
    COLLECTIVES_NS_FIELD_NUMBER: _ClassVar[int]
    STEP_NS_FIELD_NUMBER: _ClassVar[int]
    rank: int
    bytes_streamed: int
    expert_wait_ns: int
    collectives_ns: int
    step_ns: int
    def __init__(self, rank: _Optional[int] = ..., bytes_streamed: _Optional[int] = ..., expert_wait_ns: _Optional[int] = ..., collectives_ns: _Optional[int] = ..., step_ns: _Optional[int] = ...) -> None: ...

class StepResponse(_message.Message):
    __slots__ = ("seq_ids", "token_ids", "timings", "logprob_seq_ids", "logprobs", "ranks", "prompt_logprob_seq_ids", "prompt_logprobs", "faults")
    SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROB_SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FAULTS_FIELD_NUMBER: _ClassVar[int]
    seq_ids: _containers.RepeatedScalarFieldContainer[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    timings: StepTimings
    logprob_seq_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprobs]
    ranks: _containers.RepeatedCompositeFieldContainer[RankStep]
    prompt_logprob_seq_ids: _containers.RepeatedScalarFieldContainer[int]
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.PromptLogprobs]
    faults: _containers.RepeatedCompositeFieldContainer[SequenceFault]
    def __init__(self, seq_ids: _Optional[_Iterable[int]] = ..., token_ids: _Optional[_Iterable[int]] = ..., timings: _Optional[_Union[StepTimings, _Mapping]] = ..., logprob_seq_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprobs, _Mapping]]] = ..., ranks: _Optional[_Iterable[_Union[RankStep, _Mapping]]] = ..., prompt_logprob_seq_ids: _Optional[_Iterable[int]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[_common_pb2.PromptLogprobs, _Mapping]]] = ..., faults: _Optional[_Iterable[_Union[SequenceFault, _Mapping]]] = ...) -> None: ...

class SequenceFault(_message.Message):
    __slots__ = ("seq_id", "message", "invalid_argument")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    INVALID_ARGUMENT_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    message: str
    invalid_argument: bool
    def __init__(self, seq_id: _Optional[int] = ..., message: _Optional[str] = ..., invalid_argument: _Optional[bool] = ...) -> None: ...

class GetTimelineRequest(_message.Message):
    __slots__ = ("query",)
    QUERY_FIELD_NUMBER: _ClassVar[int]
    query: _common_pb2.TimelineQuery
    def __init__(self, query: _Optional[_Union[_common_pb2.TimelineQuery, _Mapping]] = ...) -> None: ...

class GetTimelineResponse(_message.Message):
    __slots__ = ("spans",)
    SPANS_FIELD_NUMBER: _ClassVar[int]
    spans: _common_pb2.TimelineSpans
    def __init__(self, spans: _Optional[_Union[_common_pb2.TimelineSpans, _Mapping]] = ...) -> None: ...
