from moe_lightning.api.common.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GetManifestRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetManifestResponse(_message.Message):
    __slots__ = ("region", "region_bytes", "model", "pages", "checkpoint_key", "load_seconds", "from_cache", "adopted")
    REGION_FIELD_NUMBER: _ClassVar[int]
    REGION_BYTES_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    PAGES_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_KEY_FIELD_NUMBER: _ClassVar[int]
    LOAD_SECONDS_FIELD_NUMBER: _ClassVar[int]
    FROM_CACHE_FIELD_NUMBER: _ClassVar[int]
    ADOPTED_FIELD_NUMBER: _ClassVar[int]
    region: str
    region_bytes: int
    model: _common_pb2.ModelInfo
    pages: _containers.RepeatedCompositeFieldContainer[_common_pb2.TensorDescriptor]
    checkpoint_key: str
    load_seconds: float
    from_cache: bool
    adopted: bool
    def __init__(self, region: _Optional[str] = ..., region_bytes: _Optional[int] = ..., model: _Optional[_Union[_common_pb2.ModelInfo, _Mapping]] = ..., pages: _Optional[_Iterable[_Union[_common_pb2.TensorDescriptor, _Mapping]]] = ..., checkpoint_key: _Optional[str] = ..., load_seconds: _Optional[float] = ..., from_cache: _Optional[bool] = ..., adopted: _Optional[bool] = ...) -> None: ...
