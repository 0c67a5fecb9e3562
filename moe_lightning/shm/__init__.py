"""The data plane: named POSIX shared-memory segments and one-writer/one-reader tensor channels."""

from moe_lightning.shm.channel import ChannelClosedError, ChannelTimeoutError, PeerDiedError, TensorChannel
from moe_lightning.shm.segment import Segment, segment_name, sweep_stale

__all__ = [
    "ChannelClosedError",
    "ChannelTimeoutError",
    "PeerDiedError",
    "Segment",
    "TensorChannel",
    "segment_name",
    "sweep_stale",
]
