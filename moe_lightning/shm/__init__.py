"""The data plane: named POSIX shared-memory segments and one-writer/one-reader tensor channels."""

from typing import Any

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
_CHANNEL = {"ChannelClosedError", "ChannelTimeoutError", "PeerDiedError", "TensorChannel"}


def __getattr__(name: str) -> Any:
    # the channel needs torch; the launcher lists and sweeps segments without paying its import
    if name in _CHANNEL:
        from moe_lightning.shm import channel

        return getattr(channel, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
