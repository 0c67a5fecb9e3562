from moe_lightning.api.common.v1 import common_pb2 as _common_pb2
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DescribeRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DescribeResponse(_message.Message):
    __slots__ = ("num_blocks", "block_size", "free_blocks", "output_channel", "measurements", "max_handoff_tokens", "kv_dtype")
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_CHANNEL_FIELD_NUMBER: _ClassVar[int]
    MEASUREMENTS_FIELD_NUMBER: _ClassVar[int]
    MAX_HANDOFF_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_DTYPE_FIELD_NUMBER: _ClassVar[int]
    num_blocks: int
    block_size: int
    free_blocks: int
    output_channel: str
    measurements: _common_pb2.HardwareMeasurements
    max_handoff_tokens: int
    kv_dtype: _common_pb2.DType
    def __init__(self, num_blocks: _Optional[int] = ..., block_size: _Optional[int] = ..., free_blocks: _Optional[int] = ..., output_channel: _Optional[str] = ..., measurements: _Optional[_Union[_common_pb2.HardwareMeasurements, _Mapping]] = ..., max_handoff_tokens: _Optional[int] = ..., kv_dtype: _Optional[_Union[_common_pb2.DType, str]] = ...) -> None: ...

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
