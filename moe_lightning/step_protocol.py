"""One decode (or prefill) step as the orchestrator plans it and the expert service runs it."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from enum import StrEnum

from moe_lightning.placement import Placement
from moe_lightning.sampling import PromptLogprobs, SamplingParams, TokenLogprobs


class StepKind(StrEnum):
    PREFILL = "prefill"  # new sequences' prompts
    DECODE = "decode"  # one token for each running sequence
    MIXED = "mixed"  # both: decodes in some micro-batches, prompt chunks in others, one weight pass


@dataclass(slots=True)
class SequenceWork:
    seq_id: int
    token_ids: list[int]  # new tokens: the prompt at prefill, the last sampled token at decode
    start: int  # tokens of this sequence already in the KV cache
    sampling: SamplingParams | None = None  # set on the sequence's first step only (and on a re-prefill)
    # with `sampling`: the random draws the sequence made before this step. 0 on its first step; a sequence
    # preempted and re-prefilled (docs/kv-cache.md) resumes its stream at the tokens it had generated
    draws: int = 0
    prompt_len: int = 0  # with `sampling`: the sequence's prompt length (penalties and prompt logprobs tell it apart)
    # the tokens its grammar allows next (structured output): ceil(V / 32) little-endian int32 words, bit
    # t % 32 of word t // 32 for token t (logits_processors.py); only on a step whose sample it keeps
    token_mask: bytes | None = None
    # the token mask comes apart from the step, filled while its layers run (gpu_expert's SetStepMasks):
    # the head waits for it only when it samples (services/gpu_expert/step_masks.py)
    mask_follows: bool = False


@dataclass(slots=True)
class StepPlan:
    step_id: int
    micro_batches: list[list[SequenceWork]]
    kind: StepKind  # the scheduler's, which knows it (a one-token prompt is still a prefill)
    # finished sequences: their KV blocks and sampler state are dropped before this step's work
    # (gpu_expert forwards the list to cpu_attention with the step's first hand-off)
    release: list[int] = field(default_factory=list)
    placement: Placement = field(default_factory=Placement)
    # groups of micro-batches whose layer FFN runs at once, each expert read once a group (0: once per
    # micro-batch; docs/cgopipe-and-benchmarks.md "Experts once per group")
    expert_groups: int = 0
    # sequences that decode (a row each): the leading micro-batches hold them, a mixed step's prompt
    # chunks follow (the share of a mixed step's time charged to decoding reads it: hrm/decode_share.py)
    decodes: int = 0

    @property
    def num_sequences(self) -> int:
        return sum(len(mb) for mb in self.micro_batches)

    @property
    def num_tokens(self) -> int:
        return sum(len(s.token_ids) for mb in self.micro_batches for s in mb)


@dataclass(slots=True)
class StepTimings:
    """gpu_expert's time in one step, in nanoseconds, by stage (docs/design.md, "Step timings").
    The stages of every layer and micro-batch are summed; a stage that did not run is 0."""

    kind: StepKind = StepKind.DECODE
    pre_attention: int = 0  # device: norm, q/k/v projections, RoPE
    post_attention: int = 0  # device: output projection, router, experts (resident, streamed or on the host)
    head: int = 0  # final norm, LM head, sampling
    # host: waiting for cpu_attention's results (its compute plus two hand-offs; with several micro-batches
    # only what the device's work on the others did not hide)
    attention_wait: int = 0
    handoff_send: int = 0  # host: putting q/k/v into the channel
    expert_wait: int = 0  # device: waiting for expert pages the copy engine had not delivered yet
    device_attention: int = 0  # device: attention over gpu_expert's own KV cache (attention placed there)
    step: int = 0  # the whole step inside the runner
    handler: int = 0  # the step plus its protobuf conversion, inside the RPC handler
    collectives: int = 0  # tensor-parallel ranks: rank 0 in gathers, scatters and all-reduces
    attention_busy: int = 0  # cpu_attention's compute for this step's hand-offs, as its replies report it
    link_busy: int = (
        0  # the copy link busy with expert pages, counted as copies end (a prefetch lands in the next step)
    )
    # of `step`, what its decode rows are charged with: all of a decode step, a mixed step's decode share
    # (hrm/decode_share.py), none of a prefill. Not a stage of its own: it is part of `step`.
    decode: int = 0

    def stages(self) -> dict[str, int]:
        """Stage name -> nanoseconds (every field but the kind)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "kind"}

    def add(self, stage: str, ns: int) -> None:
        setattr(self, stage, getattr(self, stage) + ns)


@dataclass(slots=True)
class RankStep:
    """One tensor-parallel rank's share of a step, in nanoseconds and bytes (docs/parallel.md)."""

    rank: int
    bytes_streamed: int  # its slices of the streamed experts
    expert_wait: int
    collectives: int  # in gathers, scatters and all-reduces (waiting for the slowest rank included)
    step: int


@dataclass(frozen=True, slots=True)
class SequenceFault:
    """Why the step could not sample one sequence: it alone ends (issue 54), with this message."""

    message: str
    invalid_argument: bool  # the request's own controls caused it (a 400), else the model did (INTERNAL)


@dataclass(slots=True)
class StepOutput:
    seq_ids: list[int]
    token_ids: list[int]
    timings: StepTimings
    logprobs: dict[int, TokenLogprobs] = field(default_factory=dict)  # seq id -> this step's (if asked)
    ranks: list[RankStep] = field(default_factory=list)  # tensor-parallel ranks, rank by rank
    prompt_logprobs: dict[int, PromptLogprobs] = field(default_factory=dict)  # seq id -> this step's prompt entries
    faults: dict[int, SequenceFault] = field(default_factory=dict)  # seq id -> why it got no token
