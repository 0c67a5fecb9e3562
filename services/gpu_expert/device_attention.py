"""Attention placed on the device, over gpu_expert's own KV cache: no hand-offs at all.

One of the two places a step's attention can run (the other is service_attention.py); the plan's
placement picks one per step, and both answer the runner alike. A gpu_expert started without
--device-kv-memory has no cache: its part refuses such a step before anything of it runs.
"""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import torch

from moe_lightning.kv_cache import PagedKVCache
from moe_lightning.service.errors import ServiceError
from moe_lightning.spec import ModelSpec
from moe_lightning.stages.attend import attend, plan_batch
from moe_lightning.step_protocol import SequenceWork
from services.gpu_expert.micro_batch import MicroBatchState
from services.gpu_expert.schedule import Groups, Op, local_grouped_steps, local_steps


class DeviceAttention:
    def __init__(
        self, kv: PagedKVCache, spec: ModelSpec, device: torch.device, sinks: list[torch.Tensor | None]
    ) -> None:
        """`sinks`: each layer's sink logits on `device` (GPT-OSS), or None."""
        self.kv, self.spec, self.device, self.sinks = kv, spec, device, sinks

    def check_ready(self) -> None:
        pass  # needs no attention service

    def prepare(self, release: list[int]) -> None:
        pass  # finished sequences were freed here already (`free`)

    def begin(self, mb: list[SequenceWork], st: MicroBatchState) -> None:
        """Appends the micro-batch's new tokens to the cache and plans its attention."""
        try:
            md = self.kv.begin([w.seq_id for w in mb], [len(w.token_ids) for w in mb], [w.start for w in mb])
        except ValueError as exc:
            raise ServiceError(str(exc), grpc.StatusCode.FAILED_PRECONDITION) from exc
        st.attention = plan_batch(self.spec, md, device=self.device)

    def send_release(self, step: int) -> None:
        pass  # finished sequences wait for the next step that hands off

    def order(self, num_layers: int, num_micro_batches: int, groups: Groups | None) -> Iterator[Op]:
        if groups is not None:
            return local_grouped_steps(num_layers, num_micro_batches, groups)
        return local_steps(num_layers, num_micro_batches)

    def attend(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, st: MicroBatchState
    ) -> torch.Tensor:
        assert st.attention is not None  # planned by `begin`
        plan, sinks = st.attention[layer], self.sinks[layer]
        return attend(self.spec, q, k, v, *self.kv.layer(layer), plan, sinks)

    def free(self, seq_ids: list[int]) -> None:
        for seq in seq_ids:
            self.kv.free(seq)

    def reset(self) -> None:
        self.kv.reset()


class NoDeviceAttention:
    """No device KV cache: a step that places attention here is refused in `prepare`."""

    def check_ready(self) -> None:
        pass  # the refusal names the flag; "not connected" would mislead

    def prepare(self, release: list[int]) -> None:
        raise ServiceError(
            "attention on the device was asked for, but this gpu_expert has no device KV cache "
            "(start it with --device-kv-memory)",
            grpc.StatusCode.FAILED_PRECONDITION,
        )

    def begin(self, mb: list[SequenceWork], st: MicroBatchState) -> None:
        raise AssertionError("refused in prepare")

    def send_release(self, step: int) -> None:
        pass

    def order(self, num_layers: int, num_micro_batches: int, groups: Groups | None) -> Iterator[Op]:
        raise AssertionError("refused in prepare")

    def attend(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, st: MicroBatchState
    ) -> torch.Tensor:
        raise AssertionError("refused in prepare")

    def free(self, seq_ids: list[int]) -> None:
        pass

    def reset(self) -> None:
        pass


def device_attention_part(
    kv: PagedKVCache | None, spec: ModelSpec, device: torch.device, sinks: list[torch.Tensor | None]
) -> DeviceAttention | NoDeviceAttention:
    return DeviceAttention(kv, spec, device, sinks) if kv is not None else NoDeviceAttention()
