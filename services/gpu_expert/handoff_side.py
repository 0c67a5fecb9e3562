"""This rank's side of the hand-off to cpu_attention, chosen once at start.

Rank 0 holds the link's channels (`LinkHandoff`); in a tensor-parallel group it also gathers every
rank's q/k/v heads for the one hand-off and scatters the result back by heads
(`GatheringHandoff`): tensor parallelism is a transform of the hand-off, not a branch in the step.
A rank other than 0 holds no channels and only takes part in the gather and the scatter
(`FollowerHandoff`); a runner with neither (`NoHandoff`) can run only steps that attend on the
device. Each times its own waits, so the step's timings read the same whichever it is.
"""

from __future__ import annotations

import time

import torch

from moe_lightning.handoff import HandoffHeader, QKVHandoff, SequenceBatch
from moe_lightning.step_protocol import SequenceWork, StepTimings
from services.gpu_expert.handoff_link import HandoffLink
from services.gpu_expert.ranks import RankGroup


class LinkHandoff:
    def __init__(self, link: HandoffLink) -> None:
        self.link = link
        self.connected = False
        self.unsent: list[int] = []  # finished sequences cpu_attention has not been told of

    @property
    def slots(self) -> tuple[int, int]:
        return self.link.slots

    def connect(self, input_channel: str, session: int) -> None:
        self.unsent.clear()
        self.link.connect(input_channel, session)  # stamped on every hand-off; replies of another session are stale
        self.connected = True

    def connect_rank(self, slots: tuple[int, int]) -> None:
        self.connected = True  # the link's own channels set the order

    def queue_release(self, seq_ids: list[int]) -> None:
        self.unsent.extend(seq_ids)  # kept until sent: a step that fails first must not lose them

    def send_release(self, step: int) -> None:
        if self.unsent:
            self.link.send_release(step, self.unsent)
            self.unsent = []

    def send(
        self,
        step: int,
        layer: int,
        m: int,
        qkv: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
        works: list[SequenceWork],
        timings: StepTimings,
    ) -> None:
        h0 = time.perf_counter_ns()
        batch = None
        if layer == 0:  # the first layer's hand-off tells attention which sequences the rows are
            batch = SequenceBatch(
                [w.seq_id for w in works], [len(w.token_ids) for w in works], [w.start for w in works]
            )
        header = HandoffHeader(step, layer, m, self.link.session)
        self.link.send(QKVHandoff(header, *qkv, batch))
        timings.handoff_send += time.perf_counter_ns() - h0

    def receive(self, step: int, layer: int, m: int, like: torch.Tensor, timings: StepTimings) -> torch.Tensor:
        """The attention result of (step, layer, m); `like` is the micro-batch's hidden state."""
        h0 = time.perf_counter_ns()
        attn, busy = self.link.receive(step, layer, m)
        timings.attention_wait += time.perf_counter_ns() - h0
        timings.attention_busy += busy
        return attn

    def done_with_input(self) -> None:
        self.link.done_with_input()

    def end_step(self) -> None:
        self.link.end_step()

    def drain(self) -> None:
        self.link.drain()


class GatheringHandoff(LinkHandoff):
    """Rank 0 of a group: one hand-off carries every rank's heads; each rank gets its heads back."""

    def __init__(self, link: HandoffLink, group: RankGroup) -> None:
        super().__init__(link)
        self.group = group

    def send(
        self,
        step: int,
        layer: int,
        m: int,
        qkv: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
        works: list[SequenceWork],
        timings: StepTimings,
    ) -> None:
        gathered = self.group.gather_qkv(*qkv)
        assert gathered is not None  # rank 0 gathers
        super().send(step, layer, m, gathered, works, timings)

    def receive(self, step: int, layer: int, m: int, like: torch.Tensor, timings: StepTimings) -> torch.Tensor:
        attn = super().receive(step, layer, m, like, timings)
        return self.group.scatter_heads(attn, like.shape[0], like.dtype)


class NoHandoff:
    """No channels here: rank 0 holds them (it tells the others their slot counts, which set the
    CGOPipe order every rank must follow alike)."""

    def __init__(self) -> None:
        self.connected = False
        self.slots = (1, 1)

    def connect(self, input_channel: str, session: int) -> None:
        raise RuntimeError("connect_rank: only rank 0 connects to the attention service")

    def connect_rank(self, slots: tuple[int, int]) -> None:
        self.slots = slots
        self.connected = True

    def queue_release(self, seq_ids: list[int]) -> None:
        pass  # rank 0 tells cpu_attention

    def send_release(self, step: int) -> None:
        pass

    def send(
        self,
        step: int,
        layer: int,
        m: int,
        qkv: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
        works: list[SequenceWork],
        timings: StepTimings,
    ) -> None:
        raise RuntimeError("no hand-off channel to the attention service on this runner")

    def receive(self, step: int, layer: int, m: int, like: torch.Tensor, timings: StepTimings) -> torch.Tensor:
        raise RuntimeError("no hand-off channel to the attention service on this runner")

    def done_with_input(self) -> None:
        pass

    def end_step(self) -> None:
        pass

    def drain(self) -> None:
        pass


class FollowerHandoff(NoHandoff):
    """A rank other than 0: its heads go to rank 0's gather, its share of the result comes back."""

    def __init__(self, group: RankGroup) -> None:
        super().__init__()
        self.group = group

    def send(
        self,
        step: int,
        layer: int,
        m: int,
        qkv: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
        works: list[SequenceWork],
        timings: StepTimings,
    ) -> None:
        self.group.gather_qkv(*qkv)

    def receive(self, step: int, layer: int, m: int, like: torch.Tensor, timings: StepTimings) -> torch.Tensor:
        return self.group.scatter_heads(None, like.shape[0], like.dtype)


Handoff = LinkHandoff | NoHandoff


def handoff_part(link: HandoffLink | None, group: RankGroup | None) -> Handoff:
    if group is None:
        return LinkHandoff(link) if link is not None else NoHandoff()
    return GatheringHandoff(link, group) if link is not None else FollowerHandoff(group)
