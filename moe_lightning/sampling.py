"""Head-side sampling: greedy, temperature, top-k, top-p, reproducible per request by seed; the
controls applied to the logits first (penalties, logit bias, min_tokens, a grammar's token mask)
are logits_processors.py's, and the prompt's log-probabilities prompt_logprobs.py's (docs/openai.md).

A step samples all its rows at once and reads the device once: the tokens (`sample`), and once more
the log-probabilities (`sampled_logprobs`), whatever the batch (issue 53; host_syncs.py counts it)."""

from __future__ import annotations

import math
import secrets
import struct
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from moe_lightning.exponential_race import GOLDEN, draw_seed, race

if TYPE_CHECKING:
    import torch

# torch is imported where it computes: the parameters and their checks are the API's and the command
# line's too, which answer bad input without paying torch's import (docs/api.md, "The command line")

MAX_LOGPROBS = 20
MAX_PENALTY = 2.0  # presence / frequency penalty, OpenAI's range -2..2
MAX_LOGIT_BIAS = 100.0  # a bias is -100..100, OpenAI's range
MAX_LOGIT_BIAS_TOKENS = 1024
# repetition_penalty divides a seen token's positive logit and multiplies a negative one: 1e-45 made
# logits of +inf and the step's probabilities NaN (issue 54). Within 0.01..2 a logit grows at most
# 100x (finite in fp32 for any logit an fp16 or fp32 head gives in practice); 2 is the top of the
# range OpenRouter publishes, and beyond it the penalty already flattens every seen token
MIN_REPETITION_PENALTY = 0.01
MAX_REPETITION_PENALTY = 2.0
MAX_STOP_TOKEN_IDS = 64
# `sample`'s token for a row it could not draw from: NaN or +inf among its logits, or no token allowed
# (every logit -inf). Marked in the tokens the step copies to the host anyway: no sync of its own.
NOT_FINITE = -1


@dataclass(frozen=True, slots=True)
class TokenLogprobs:
    """log_softmax of the raw logits at one generated position."""

    token_id: int
    logprob: float
    top_token_ids: list[int]
    top_logprobs: list[float]


@dataclass(frozen=True, slots=True)
class PromptLogprobs:
    """The log-probabilities of a run of prompt tokens, each given the tokens before it: entry i is the
    prompt's token at position `first_position + i` (position 0, the first token, has none)."""

    first_position: int
    entries: list[TokenLogprobs]


@dataclass(frozen=True, slots=True)
class SamplingParams:
    temperature: float = 0.0  # 0 means greedy
    top_k: int = 0  # 0 means no top-k cut
    top_p: float = 1.0  # nucleus mass kept, in (0, 1]
    seed: int | None = None  # fixes the request's random stream; None draws one
    logprobs: int = 0  # return the top this-many log-probabilities at each generated position
    # what changes the logits before sampling (logits_processors.py); logprobs are the raw logits' still
    presence_penalty: float = 0.0  # OpenAI's: minus this for every token already generated
    frequency_penalty: float = 0.0  # OpenAI's: minus this times how often a token was generated
    repetition_penalty: float = 1.0  # transformers' / vLLM's: prompt and output tokens' logits divided (>0) or times it
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit), OpenAI's logit_bias
    min_tokens: int = 0  # EOS and stop_token_ids cannot end the output (nor a stop string) before this many
    stop_token_ids: tuple[int, ...] = ()  # tokens that end the output, as EOS does (not in its text)
    # the prompt's log-probabilities, with the top this-many at each position; None: not computed
    prompt_logprobs: int | None = None

    def __post_init__(self) -> None:
        # the one definition of what is allowed: the API turns these into INVALID_ARGUMENT (in this order)
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = disabled), got {self.top_k}")
        if not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ValueError(f"logprobs must be in 0..{MAX_LOGPROBS}, got {self.logprobs}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not (math.isfinite(value) and -MAX_PENALTY <= value <= MAX_PENALTY):
                raise ValueError(f"{name} must be in -{MAX_PENALTY:g}..{MAX_PENALTY:g}, got {value}")
        rep = self.repetition_penalty
        # compared as the API's fp32 field holds it: 0.01 there is 0.0099999998, and must still pass
        if not (math.isfinite(rep) and _f32(MIN_REPETITION_PENALTY) <= _f32(rep) <= MAX_REPETITION_PENALTY):
            raise ValueError(
                f"repetition_penalty must be in {MIN_REPETITION_PENALTY:g}..{MAX_REPETITION_PENALTY:g} (1 = none), "
                f"got {rep}"
            )
        if len(self.logit_bias) > MAX_LOGIT_BIAS_TOKENS:
            raise ValueError(f"logit_bias takes at most {MAX_LOGIT_BIAS_TOKENS} tokens, got {len(self.logit_bias)}")
        for token, bias in self.logit_bias:
            if token < 0:
                raise ValueError(f"logit_bias token ids are >= 0, got {token}")
            if not (math.isfinite(bias) and -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS):
                raise ValueError(f"logit_bias values must be in -{MAX_LOGIT_BIAS:g}..{MAX_LOGIT_BIAS:g}, got {bias}")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens}")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS or any(t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids takes at most {MAX_STOP_TOKEN_IDS} token ids, each >= 0")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= MAX_LOGPROBS:
            raise ValueError(f"prompt_logprobs must be in 0..{MAX_LOGPROBS}, got {self.prompt_logprobs}")

    @property
    def penalized(self) -> bool:
        """Whether the generated (or prompt) tokens change the logits."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)

    @property
    def processed(self) -> bool:
        """Whether anything changes the logits before sampling (logits_processors.py)."""
        return self.penalized or bool(self.logit_bias or self.min_tokens)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    def with_seed(self) -> SamplingParams:
        """These parameters with a seed fixed: a drawn one when none was asked for, so a sequence that
        is preempted and re-prefilled on another step resumes the same stream (greedy needs none)."""
        if self.greedy or self.seed is not None:
            return self
        return replace(self, seed=secrets.randbits(63))


def _f32(value: float) -> float:
    """`value` rounded to fp32, as a protobuf float field carries it (beyond fp32's range: +-inf)."""
    if abs(value) > 3.4028235677973366e38:  # past the largest fp32's rounding interval: struct raises
        return math.copysign(math.inf, value)
    return struct.unpack("f", struct.pack("f", value))[0]


@dataclass(slots=True)
class SequenceSampler:
    """One sequence's sampling parameters and random stream, where the head keeps them.

    Each draw's randomness comes from (seed, draw index) alone (`next_key`): a sequence preempted and
    re-prefilled (docs/kv-cache.md) is given the draws it had made and continues its stream exactly.
    With penalties it also keeps the sequence's tokens as the steps feed them (prompt, then output): a
    re-prefill feeds them all again, so the state rebuilds itself after a preemption."""

    params: SamplingParams
    seed: int
    draws: int = 0  # draws made so far: the index of the next
    prompt_len: int = 0  # the sequence's prompt, in tokens (0: not sent)
    tokens: list[int] | None = None  # prompt + output as fed, when params.penalized
    pending_logprobs: torch.Tensor | None = None  # (V,) log-softmax of a chunk's last prompt row (prompt_logprobs.py)

    @classmethod
    def start(
        cls, params: SamplingParams, draws: int = 0, device: torch.device | str = "cpu", prompt_len: int = 0
    ) -> SequenceSampler:
        """`device` is unused, kept for the callers: a draw keeps no state on a device (its key is enough)."""
        seed = params.seed if params.seed is not None else secrets.randbits(63)
        return cls(params, seed, draws, prompt_len, [] if params.penalized else None)

    def resume(self, draws: int) -> None:
        """The next chunk of a prompt that spans steps: the stream is back at `draws` (a chunk short of
        the prompt's end sampled a token nobody kept)."""
        self.draws = draws

    def feed(self, start: int, token_ids: Sequence[int]) -> None:
        """The tokens a step computes for this sequence, from position `start`."""
        if self.tokens is not None:
            del self.tokens[start:]
            self.tokens.extend(token_ids)

    @property
    def complete(self) -> bool:
        """Every token before the next draw has been fed: the draw is one the sequence keeps (a chunk
        short of a prompt's end samples too, and throws it away)."""
        return self.tokens is None or len(self.tokens) == self.prompt_len + self.draws

    @property
    def output(self) -> list[int]:
        """The generated tokens so far (with history kept and the sampler complete)."""
        return [] if self.tokens is None else self.tokens[self.prompt_len :]

    def next_key(self) -> int | None:
        """The key of the next draw, `draw_seed(seed, draw index)` (None when greedy), for `sample`."""
        key = None if self.params.greedy else draw_seed(self.seed, self.draws)
        self.draws += 1
        return key


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """logits: (B, V) fp32 -> each row's first maximum (B,) int64, NaN counting as the maximum, as
    torch.argmax has it. The head's GEMM may leave the logits as a (V, B) tensor viewed as (B, V)
    (quant/kernels.py's `weight_major`), where torch's argmax over the strided last dim took 22 ms at
    256 x 32000 (a quarter of the head): the native kernel reads the (V, B) rows as they lie (0.65 ms).
    Over contiguous rows torch.max's indices (2.2 ms) beat torch.argmax (6.3 ms) on the same CPU."""
    import torch

    if logits.dim() == 2 and logits.shape[0] > 1 and logits.device.type == "cpu":
        if logits.stride(-1) == 1:
            return torch.max(logits, dim=-1).indices
        if logits.T.is_contiguous() and logits.dtype == torch.float32:
            from moe_lightning.quant import host_kernels

            picked = host_kernels.argmax_columns(logits.T)
            if picked is not None:
                return picked
    return torch.argmax(logits, dim=-1)


_CPU_BLOCK = 1 << 17  # elements a CPU samples at once: int64 temporaries in cache, 4x faster at 256 x 32000


def _on(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Per-row parameters built on the host, on `device` without the host waiting: a copy from pageable
    memory would make torch synchronise the stream, one from pinned memory is queued."""
    if device.type == "cpu":
        return host
    if device.type == "cuda":
        host = host.pin_memory()
    return host.to(device, non_blocking=True)


def _rows(logits: torch.Tensor, index: torch.Tensor, host: Sequence[int], lo: int, hi: int) -> torch.Tensor:
    """logits' rows host[lo:hi] (index: the same on the device): a view where they are consecutive, as
    when every row asks, else a copy."""
    first = host[lo]
    if all(host[i] == first + i - lo for i in range(lo, hi)):
        return logits[first : first + hi - lo]
    return logits.index_select(0, index[lo:hi])


@contextmanager
def _one_thread(device: torch.device) -> Iterator[None]:
    """On a CPU, torch on one intra-op thread: the blocks of rows are too small to split, and a pool
    that waits for its other thread on a shared host's scheduler made sampling 2-5x slower (a 2-core
    VM, as hrm/host_issue.py found); one thread samples faster than the row-by-row code did on two."""
    import torch

    threads = torch.get_num_threads()
    if device.type != "cpu" or threads == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _checked_greedy(logits: torch.Tensor) -> torch.Tensor:
    """greedy_tokens, NOT_FINITE where the row's maximum is not finite: NaN counts as the maximum, so
    the picked logits (B of them) tell NaN, +inf and an all -inf row apart from a sound row."""
    picked = greedy_tokens(logits)
    return picked.masked_fill_(~logits.gather(1, picked[:, None]).squeeze(1).isfinite(), NOT_FINITE)


def sample(logits: torch.Tensor, params: Sequence[SamplingParams], keys: Sequence[int | None]) -> torch.Tensor:
    """logits: (B, V) -> next token ids (B,) on the CPU, NOT_FINITE for a row whose logits are not
    finite (the others are drawn as if it were not there). keys: each row's draw key (`next_key`; None
    for a greedy row, and a non-greedy row without one draws a random one). On a device, a constant
    number of launches and one copy to the host, the result's, whatever the batch and its rows ask."""
    import torch

    drawn = [b for b, p in enumerate(params) if not p.greedy]
    if not drawn:
        return _checked_greedy(logits).cpu()
    vocab = logits.shape[-1]

    def kind(b: int) -> int:  # 0: top-p, 1: top-p and top-k, 2: top-k, 3: temperature alone
        p, cut = params[b], 0 < params[b].top_k < vocab
        return (1 if cut else 0) if p.top_p < 1.0 else 2 if cut else 3

    # rows of a kind side by side, so that the top-k rows (kinds 1, 2) and the top-p rows (0, 1) are
    # slices, each filter one launch over its slice
    drawn.sort(key=kind)
    n = [sum(kind(b) == k for b in drawn) for k in range(4)]
    ints = torch.tensor(
        [[b, secrets.randbits(63) if keys[b] is None else keys[b], min(params[b].top_k or vocab, vocab)] for b in drawn]
    )
    floats = torch.tensor([[params[b].temperature, params[b].top_p] for b in drawn], dtype=torch.float64)
    dev = _on(torch.cat([ints, floats.view(torch.int64)], dim=1), logits.device)  # one copy: (S, 5)
    rows, key, top_k = dev[:, 0], dev[:, 1], dev[:, 2:3]
    temperature, top_p = (dev[:, c : c + 1].view(torch.float64).float() for c in (3, 4))
    temperature.clamp_min_(torch.finfo(torch.float32).tiny)  # a temperature below fp32's range is not 0
    steps = torch.arange(vocab, device=logits.device)[None].mul_(GOLDEN).add_(GOLDEN)  # race_noise's
    cut_lo, nucleus_hi = n[0], n[0] + n[1]
    cut_hi = nucleus_hi + n[2]

    def draw(lo: int, hi: int) -> torch.Tensor:  # the drawn rows lo..hi, all top-p ones or none
        x = _rows(logits, rows, drawn, lo, hi).float()
        # shift first: with a tiny temperature, logits / T overflows to +inf and softmax gives NaN;
        # shifted logits are <= 0, so they can only underflow to -inf (the maximum stays at 0)
        top = x.amax(dim=-1, keepdim=True)
        x = (x - top).div_(temperature[lo:hi])
        # amax propagates NaN: a row with NaN, +inf or nothing allowed has no finite maximum
        return pick(lo, hi, x).masked_fill_(~top.squeeze(1).isfinite(), NOT_FINITE)

    def pick(lo: int, hi: int, x: torch.Tensor) -> torch.Tensor:
        c_lo, c_hi = max(lo, cut_lo), min(hi, cut_hi)
        if c_lo < c_hi:
            # each row's k-th value from one topk to the largest k asked; ties with it stay, as in
            # vLLM's apply_top_k_top_p, and the top-p rows then sort rows of mostly -inf (5x faster)
            cut = x[c_lo - lo : c_hi - lo]
            k_max = max(params[b].top_k for b in drawn[c_lo:c_hi])
            cut.masked_fill_(cut < cut.topk(k_max, dim=-1).values.gather(1, top_k[c_lo:c_hi] - 1), float("-inf"))
        if lo >= nucleus_hi:
            return race(x, key[lo:hi], steps, stepped=True)
        # vLLM's top-p mask on the sorted logits: a token goes once the mass before it already
        # reaches top_p, so the most likely always stays; the race runs in the sorted order
        srt, order = x.sort(dim=-1, descending=True)
        probs = srt.softmax(dim=-1)
        srt.masked_fill_(probs.cumsum(dim=-1).sub_(probs) >= top_p[lo:hi], float("-inf"))
        return race(srt, key[lo:hi], order, stepped=False)

    # on a device each part is one launch of each operation; on a CPU a few rows at a time keep the
    # temporaries in cache (a 32 MB buffer is fresh pages on every call)
    block = max(1, _CPU_BLOCK // vocab) if logits.device.type == "cpu" else len(drawn)
    parts = ((0, nucleus_hi), (nucleus_hi, len(drawn)))
    with _one_thread(logits.device):
        picked = [draw(i, min(i + block, hi)) for lo, hi in parts for i in range(lo, hi, block)]
    tokens = picked[0] if len(picked) == 1 else torch.cat(picked)
    if len(drawn) == len(params):
        return torch.empty_like(tokens).index_copy_(0, rows, tokens).cpu()
    return _checked_greedy(logits).index_copy_(0, rows, tokens).cpu()


def sampled_logprobs(logits: torch.Tensor, asked: Sequence[tuple[int, int, int]]) -> list[TokenLogprobs]:
    """logits: (B, V) raw; asked: (row, its sampled token, how many top) -> each one's TokenLogprobs,
    log_softmax of the raw fp32 logits: one log_softmax, topk and gather over the rows that ask (the
    top padded to the most asked) and one copy to the host, whatever the batch."""
    import torch

    if not asked:
        return []
    vocab = logits.shape[-1]
    index = _on(torch.tensor([(row, token) for row, token, _ in asked]), logits.device)  # (R, 2)
    rows = [row for row, _, _ in asked]
    top = min(max(t for _, _, t in asked), vocab)

    def part(lo: int, hi: int) -> torch.Tensor:  # (hi - lo, 1 + 2 top): the token's, the top values, their ids
        lp = torch.log_softmax(_rows(logits, index[:, 0], rows, lo, hi).float(), dim=-1)
        cols = [lp.gather(1, index[lo:hi, 1:]), *(lp.topk(top, dim=-1) if top else ())]
        return torch.cat([c.double() for c in cols], dim=1)  # fp64 holds fp32 values and ids < 2^53 exactly

    block = max(1, _CPU_BLOCK // vocab) if logits.device.type == "cpu" else len(asked)  # as `sample`'s
    with _one_thread(logits.device):
        host = torch.cat([part(i, min(i + block, len(asked))) for i in range(0, len(asked), block)]).tolist()
    out = []
    for (_, token, k), row in zip(asked, host, strict=True):
        k = min(k, vocab)
        out.append(TokenLogprobs(token, row[0], [int(i) for i in row[1 + top : 1 + top + k]], row[1 : 1 + k]))
    return out
