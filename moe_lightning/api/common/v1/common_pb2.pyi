from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DTYPE_UNSPECIFIED: _ClassVar[DType]
    DTYPE_FLOAT32: _ClassVar[DType]
    DTYPE_FLOAT16: _ClassVar[DType]
    DTYPE_BFLOAT16: _ClassVar[DType]
    DTYPE_INT64: _ClassVar[DType]
    DTYPE_INT32: _ClassVar[DType]
    DTYPE_INT8: _ClassVar[DType]
    DTYPE_UINT8: _ClassVar[DType]
DTYPE_UNSPECIFIED: DType
DTYPE_FLOAT32: DType
DTYPE_FLOAT16: DType
DTYPE_BFLOAT16: DType
DTYPE_INT64: DType
DTYPE_INT32: DType
DTYPE_INT8: DType
DTYPE_UINT8: DType

class TensorDescriptor(_message.Message):
    __slots__ = ("name", "region", "offset", "nbytes", "dtype", "shape")
    NAME_FIELD_NUMBER: _ClassVar[int]
    REGION_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    name: str
    region: str
    offset: int
    nbytes: int
    dtype: DType
    shape: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, name: _Optional[str] = ..., region: _Optional[str] = ..., offset: _Optional[int] = ..., nbytes: _Optional[int] = ..., dtype: _Optional[_Union[DType, str]] = ..., shape: _Optional[_Iterable[int]] = ...) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("architecture", "num_layers", "hidden_size", "intermediate_size", "num_heads", "num_kv_heads", "head_dim", "num_experts", "top_k", "vocab_size", "max_position_embeddings", "dtype", "num_parameters", "spec_json", "model_path")
    ARCHITECTURE_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    INTERMEDIATE_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_HEADS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    NUM_EXPERTS_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_POSITION_EMBEDDINGS_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    NUM_PARAMETERS_FIELD_NUMBER: _ClassVar[int]
    SPEC_JSON_FIELD_NUMBER: _ClassVar[int]
    MODEL_PATH_FIELD_NUMBER: _ClassVar[int]
    architecture: str
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    num_experts: int
    top_k: int
    vocab_size: int
    max_position_embeddings: int
    dtype: str
    num_parameters: int
    spec_json: str
    model_path: str
    def __init__(self, architecture: _Optional[str] = ..., num_layers: _Optional[int] = ..., hidden_size: _Optional[int] = ..., intermediate_size: _Optional[int] = ..., num_heads: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., num_experts: _Optional[int] = ..., top_k: _Optional[int] = ..., vocab_size: _Optional[int] = ..., max_position_embeddings: _Optional[int] = ..., dtype: _Optional[str] = ..., num_parameters: _Optional[int] = ..., spec_json: _Optional[str] = ..., model_path: _Optional[str] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_k", "top_p", "seed", "logprobs", "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "min_tokens", "stop_token_ids", "prompt_logprobs")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_k: int
    top_p: float
    seed: int
    logprobs: int
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    logit_bias: _containers.ScalarMap[int, float]
    min_tokens: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    prompt_logprobs: int
    def __init__(self, temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., seed: _Optional[int] = ..., logprobs: _Optional[int] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., min_tokens: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., prompt_logprobs: _Optional[int] = ...) -> None: ...

class PromptLogprobs(_message.Message):
    __slots__ = ("first_position", "top", "token_ids", "logprobs", "top_token_ids", "top_logprobs")
    FIRST_POSITION_FIELD_NUMBER: _ClassVar[int]
    TOP_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    first_position: int
    top: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    top_token_ids: _containers.RepeatedScalarFieldContainer[int]
    top_logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, first_position: _Optional[int] = ..., top: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ..., top_token_ids: _Optional[_Iterable[int]] = ..., top_logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class TokenLogprobs(_message.Message):
    __slots__ = ("token_id", "logprob", "top_token_ids", "top_logprobs", "token", "top_tokens")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    TOP_TOKENS_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    top_token_ids: _containers.RepeatedScalarFieldContainer[int]
    top_logprobs: _containers.RepeatedScalarFieldContainer[float]
    token: str
    top_tokens: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., top_token_ids: _Optional[_Iterable[int]] = ..., top_logprobs: _Optional[_Iterable[float]] = ..., token: _Optional[str] = ..., top_tokens: _Optional[_Iterable[str]] = ...) -> None: ...

class HardwareMeasurements(_message.Message):
    __slots__ = ("matmul_flops", "weight_stream_bandwidth", "attention_bandwidth", "memory_bytes", "h2d_bandwidth", "d2h_bandwidth", "shared_host_device", "source", "expert_format", "expert_matmul_flops", "expert_stream_bandwidth", "simulated_link", "host_micro_batch_seconds", "host_ffn_seconds", "host_expert_seconds")
    MATMUL_FLOPS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_STREAM_BANDWIDTH_FIELD_NUMBER: _ClassVar[int]
    ATTENTION_BANDWIDTH_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    H2D_BANDWIDTH_FIELD_NUMBER: _ClassVar[int]
    D2H_BANDWIDTH_FIELD_NUMBER: _ClassVar[int]
    SHARED_HOST_DEVICE_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    EXPERT_FORMAT_FIELD_NUMBER: _ClassVar[int]
    EXPERT_MATMUL_FLOPS_FIELD_NUMBER: _ClassVar[int]
    EXPERT_STREAM_BANDWIDTH_FIELD_NUMBER: _ClassVar[int]
    SIMULATED_LINK_FIELD_NUMBER: _ClassVar[int]
    HOST_MICRO_BATCH_SECONDS_FIELD_NUMBER: _ClassVar[int]
    HOST_FFN_SECONDS_FIELD_NUMBER: _ClassVar[int]
    HOST_EXPERT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    matmul_flops: float
    weight_stream_bandwidth: float
    attention_bandwidth: float
    memory_bytes: float
    h2d_bandwidth: float
    d2h_bandwidth: float
    shared_host_device: bool
    source: str
    expert_format: str
    expert_matmul_flops: float
    expert_stream_bandwidth: float
    simulated_link: bool
    host_micro_batch_seconds: float
    host_ffn_seconds: float
    host_expert_seconds: float
    def __init__(self, matmul_flops: _Optional[float] = ..., weight_stream_bandwidth: _Optional[float] = ..., attention_bandwidth: _Optional[float] = ..., memory_bytes: _Optional[float] = ..., h2d_bandwidth: _Optional[float] = ..., d2h_bandwidth: _Optional[float] = ..., shared_host_device: _Optional[bool] = ..., source: _Optional[str] = ..., expert_format: _Optional[str] = ..., expert_matmul_flops: _Optional[float] = ..., expert_stream_bandwidth: _Optional[float] = ..., simulated_link: _Optional[bool] = ..., host_micro_batch_seconds: _Optional[float] = ..., host_ffn_seconds: _Optional[float] = ..., host_expert_seconds: _Optional[float] = ...) -> None: ...

class TimelineSpans(_message.Message):
    __slots__ = ("names", "resource", "stage", "step", "layer", "micro_batch", "start_ns", "end_ns", "service")
    NAMES_FIELD_NUMBER: _ClassVar[int]
    RESOURCE_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    LAYER_FIELD_NUMBER: _ClassVar[int]
    MICRO_BATCH_FIELD_NUMBER: _ClassVar[int]
    START_NS_FIELD_NUMBER: _ClassVar[int]
    END_NS_FIELD_NUMBER: _ClassVar[int]
    SERVICE_FIELD_NUMBER: _ClassVar[int]
    names: _containers.RepeatedScalarFieldContainer[str]
    resource: _containers.RepeatedScalarFieldContainer[int]
    stage: _containers.RepeatedScalarFieldContainer[int]
    step: _containers.RepeatedScalarFieldContainer[int]
    layer: _containers.RepeatedScalarFieldContainer[int]
    micro_batch: _containers.RepeatedScalarFieldContainer[int]
    start_ns: _containers.RepeatedScalarFieldContainer[int]
    end_ns: _containers.RepeatedScalarFieldContainer[int]
    service: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, names: _Optional[_Iterable[str]] = ..., resource: _Optional[_Iterable[int]] = ..., stage: _Optional[_Iterable[int]] = ..., step: _Optional[_Iterable[int]] = ..., layer: _Optional[_Iterable[int]] = ..., micro_batch: _Optional[_Iterable[int]] = ..., start_ns: _Optional[_Iterable[int]] = ..., end_ns: _Optional[_Iterable[int]] = ..., service: _Optional[_Iterable[int]] = ...) -> None: ...

class TimelineQuery(_message.Message):
    __slots__ = ("steps", "start_ns", "end_ns")
    STEPS_FIELD_NUMBER: _ClassVar[int]
    START_NS_FIELD_NUMBER: _ClassVar[int]
    END_NS_FIELD_NUMBER: _ClassVar[int]
    steps: int
    start_ns: int
    end_ns: int
    def __init__(self, steps: _Optional[int] = ..., start_ns: _Optional[int] = ..., end_ns: _Optional[int] = ...) -> None: ...
