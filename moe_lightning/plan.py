"""One decode (or prefill) step as the orchestrator plans it and the expert service runs it."""

from __future__ import annotations

from dataclasses import dataclass, field

from moe_lightning.sampling import SamplingParams, TokenLogprobs


@dataclass(slots=True)
class SequenceWork:
    seq_id: int
    token_ids: list[int]  # new tokens: the prompt at prefill, the last sampled token at decode
    start: int  # tokens of this sequence already in the KV cache
    sampling: SamplingParams | None = None  # set on the sequence's first step only


@dataclass(slots=True)
class StepPlan:
    step_id: int
    micro_batches: list[list[SequenceWork]]
    release: list[int] = field(default_factory=list)  # finished sequences: drop their sampler state
    attention_on_device: bool = False  # placement: attention in gpu_expert, over its own KV cache
    experts_on_host: bool = False  # placement: non-resident experts computed on the host, not streamed

    @property
    def num_sequences(self) -> int:
        return sum(len(mb) for mb in self.micro_batches)

    @property
    def num_tokens(self) -> int:
        return sum(len(s.token_ids) for mb in self.micro_batches for s in mb)


@dataclass(slots=True)
class StepOutput:
    seq_ids: list[int]
    token_ids: list[int]
    timings_ns: dict[str, int]
    logprobs: dict[int, TokenLogprobs] = field(default_factory=dict)  # seq id -> this step's (if asked)
