"""Page-locking host memory we did not allocate (the weight arena, the hand-off channels) for CUDA.

Copies between the device and registered memory are DMA transfers that run on a stream without
the CPU; from pageable memory they are staged by the driver and block the host. PyTorch has no
public call that registers foreign memory, so this goes through `torch.cuda.cudart()`.
"""

from __future__ import annotations

import structlog
import torch
from prometheus_client import Gauge

CUDA_HOST_REGISTER_PORTABLE = 1  # pinned for every CUDA context, not just the calling one's
PINNED = Gauge("moe_lightning_pinned_host_bytes", "Host memory registered as page-locked for the device")


def pin_host_memory(buffer: torch.Tensor, device: torch.device) -> bool:
    """Registers `buffer`'s memory as page-locked for `device`. Returns False where that is not
    possible (no CUDA, or the driver refused); copies then still work, synchronously."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return False
    ptr, size = buffer.data_ptr(), buffer.numel() * buffer.element_size()
    with torch.cuda.device(device):  # the context of cuda:N, not the current device's
        err = torch.cuda.cudart().cudaHostRegister(ptr, size, CUDA_HOST_REGISTER_PORTABLE)
        ok = int(getattr(err, "value", err)) == 0
        if not ok:
            _clear_last_error(device)
    log = structlog.get_logger()
    if ok:
        PINNED.inc(size)
        log.info("host_memory_pinned", bytes=size)
    else:
        log.warning("host_memory_not_pinned", bytes=size, cuda_error=str(err))
    return ok


def unpin_host_memory(buffer: torch.Tensor, device: torch.device) -> None:
    if device.type == "cuda" and torch.cuda.is_available():
        with torch.cuda.device(device):
            torch.cuda.cudart().cudaHostUnregister(buffer.data_ptr())
        PINNED.dec(buffer.numel() * buffer.element_size())


def _clear_last_error(device: torch.device) -> None:
    """A failed cudaHostRegister leaves CUDA's per-thread last error set, and PyTorch's check after
    the next kernel launch (cudaGetLastError) would raise it there, far from its cause. That check
    also clears it: launch one throwaway kernel and swallow what it reports."""
    try:
        torch.zeros(1, device=device).add_(1)
    except RuntimeError as exc:
        structlog.get_logger().info("cuda_last_error_cleared", error=str(exc).splitlines()[0])
