"""What would synchronise a CUDA device with the host, counted on any device (the CPU included), so that
a CPU test can say how often code would make the host wait for a GPU: e.g. that a step's count does not
grow with its batch (issue 53). On CUDA, `gpu_expert --count-syncs` counts the real ones instead
(services/gpu_expert/sync_count.py, torch's sync debug mode).

Counted, by kind:
* reading a tensor's values into Python: `item`, `tolist`, `numpy`, `cpu`, `to` onto the CPU, and
  `bool` / `int` / `float` / `index` of a tensor (an `if t:`, a `range(t)`);
* the operators whose output's size or a check of theirs reads the values: `nonzero`, `masked_select`,
  `unique`, `repeat_interleave`, `equal`, `multinomial` (its validity checks), `_local_scalar_dense`,
  and indexing by a boolean mask, seen by a TorchDispatchMode.

Not counted: copies onto the device (`torch.tensor(..., device=)`, `to("cuda")`, which torch makes
blocking from pageable memory), invisible on a CPU; nor what a C++ kernel does inside one operator.
Every tensor counts, a host-only one too: code under count should read back only what would be on
the device. Only the thread that opened the context is counted (the method patches are process-wide
while it lasts, the dispatch mode is per thread): a service's other threads are not its step.
"""

from __future__ import annotations

import functools
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_READS = ("item", "tolist", "numpy", "cpu", "__bool__", "__int__", "__float__", "__index__")
_SYNCING_OPS = {
    "_local_scalar_dense",
    "nonzero",
    "masked_select",
    "_unique",
    "_unique2",
    "unique_dim",
    "unique_consecutive",
    "repeat_interleave",
    "equal",
    "multinomial",
}
_INDEXING_OPS = {"index", "index_put", "index_put_", "_index_put_impl_"}


@dataclass
class HostSyncs:
    """The syncs seen so far, by kind (a method's name, or `aten.<op>`)."""

    kinds: Counter[str] = field(default_factory=Counter)

    @property
    def count(self) -> int:
        return sum(self.kinds.values())


_inside = threading.local()  # a counted read's own operators (item's _local_scalar_dense) count once


def _counted(kind: str, method: Callable[..., Any], syncs: HostSyncs, owner: int) -> Callable[..., Any]:
    @functools.wraps(method)
    def read(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if threading.get_ident() != owner:  # another thread's reads (the patches are process-wide)
            return method(self, *args, **kwargs)
        if kind == "to":
            device = torch._C._nn._parse_to(*args, **kwargs)[0]
            if device is None or device.type != "cpu":
                return method(self, *args, **kwargs)
        depth = getattr(_inside, "depth", 0)
        if depth == 0:
            syncs.kinds[kind] += 1
        _inside.depth = depth + 1
        try:
            return method(self, *args, **kwargs)
        finally:
            _inside.depth = depth

    return read


class _SyncingOps(TorchDispatchMode):
    def __init__(self, syncs: HostSyncs) -> None:
        super().__init__()
        self.syncs = syncs

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        name = func.overloadpacket.__name__
        if getattr(_inside, "depth", 0) == 0:
            masked = name in _INDEXING_OPS and any(
                isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in _indices(args)
            )
            if name in _SYNCING_OPS or masked:
                self.syncs.kinds[f"aten.{name}"] += 1
        return func(*args, **(kwargs or {}))


def _indices(args: tuple) -> list:
    # index(self, indices) and index_put(self, indices, values, ...): the indices are a list
    return list(args[1]) if len(args) > 1 and isinstance(args[1], list | tuple) else []


@contextmanager
def count_host_syncs() -> Iterator[HostSyncs]:
    """Counts, inside the block, what would make the host wait for a CUDA device (see the module)."""
    syncs = HostSyncs()
    saved = {name: getattr(torch.Tensor, name) for name in (*_READS, "to")}
    own = {name for name in saved if name in vars(torch.Tensor)}  # the rest are TensorBase's, inherited
    patched: list[str] = []
    try:
        for name, method in saved.items():
            setattr(torch.Tensor, name, _counted(name, method, syncs, threading.get_ident()))
            patched.append(name)
        with _SyncingOps(syncs):
            yield syncs
    finally:
        for name in patched:
            if name in own:
                setattr(torch.Tensor, name, saved[name])
            else:
                delattr(torch.Tensor, name)
