"""Head-side sampling: greedy, temperature, top-k, top-p, reproducible per request by seed; the
controls applied to the logits first (penalties, logit bias, min_tokens, a grammar's token mask)
are logits_processors.py's, and the prompt's log-probabilities prompt_logprobs.py's (docs/openai.md)."""

from __future__ import annotations

import math
import secrets
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

# torch is imported where it computes: the parameters and their checks are the API's and the command
# line's too, which answer bad input without paying torch's import (docs/api.md, "The command line")

MAX_LOGPROBS = 20
MAX_PENALTY = 2.0  # presence / frequency penalty, OpenAI's range -2..2
MAX_LOGIT_BIAS = 100.0  # a bias is -100..100, OpenAI's range
MAX_LOGIT_BIAS_TOKENS = 1024
MAX_STOP_TOKEN_IDS = 64


@dataclass(frozen=True, slots=True)
class TokenLogprobs:
    """log_softmax of the raw logits at one generated position."""

    token_id: int
    logprob: float
    top_token_ids: list[int]
    top_logprobs: list[float]


def token_logprobs(logits: torch.Tensor, token: int, top: int) -> TokenLogprobs:
    """logits: (V,) raw, fp32."""
    import torch

    lp = torch.log_softmax(logits.float(), dim=-1)
    values, ids = torch.topk(lp, min(top, lp.shape[-1]))
    return TokenLogprobs(token, float(lp[token]), ids.tolist(), values.tolist())


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
        if not (math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0):
            raise ValueError(f"repetition_penalty must be a number > 0 (1 = none), got {self.repetition_penalty}")
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

    def make_generator(self, device: torch.device | str = "cpu") -> torch.Generator | None:
        if self.greedy:
            return None
        import torch

        gen = torch.Generator(device=device)
        gen.manual_seed(self.seed if self.seed is not None else secrets.randbits(63))
        return gen

    def with_seed(self) -> SamplingParams:
        """These parameters with a seed fixed: a drawn one when none was asked for, so a sequence that
        is preempted and re-prefilled on another step resumes the same stream (greedy needs none)."""
        if self.greedy or self.seed is not None:
            return self
        return replace(self, seed=secrets.randbits(63))


_MASK64 = (1 << 64) - 1


def draw_seed(seed: int, draw: int) -> int:
    """The seed of a stream's `draw`-th draw: splitmix64 of (seed, draw), so draw i depends on the two
    numbers alone and not on how many steps produced the draws before it."""
    z = (seed + (draw + 1) * 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) & ((1 << 63) - 1)


@dataclass(slots=True)
class SequenceSampler:
    """One sequence's sampling parameters and random stream, where the head keeps them.

    Each draw reseeds the generator from (seed, draw index): a sequence preempted and re-prefilled
    (docs/kv-cache.md) is given the draws it had made and continues its stream exactly, while one
    generator object per sequence keeps the per-token cost to a reseed. With penalties it also keeps
    the sequence's tokens as the steps feed them (prompt, then output): a re-prefill feeds them all
    again, so the state rebuilds itself after a preemption."""

    params: SamplingParams
    generator: torch.Generator | None
    seed: int
    draws: int = 0  # draws made so far: the index of the next
    prompt_len: int = 0  # the sequence's prompt, in tokens (0: not sent)
    tokens: list[int] | None = None  # prompt + output as fed, when params.penalized
    pending_logprobs: torch.Tensor | None = None  # (V,) log-softmax of a chunk's last prompt row (prompt_logprobs.py)

    @classmethod
    def start(
        cls, params: SamplingParams, draws: int = 0, device: torch.device | str = "cpu", prompt_len: int = 0
    ) -> SequenceSampler:
        seed = params.seed if params.seed is not None else secrets.randbits(63)
        generator = None
        if not params.greedy:
            import torch

            generator = torch.Generator(device=device)
        return cls(params, generator, seed, draws, prompt_len, [] if params.penalized else None)

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

    def next_generator(self) -> torch.Generator | None:
        """The generator for the next draw (None when greedy), seeded for it."""
        if self.generator is not None:
            self.generator.manual_seed(draw_seed(self.seed, self.draws))
        self.draws += 1
        return self.generator


def _filter(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    import torch

    # logits: (V,) fp32, already divided by temperature
    if params.top_k > 0 and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # drop a token once the mass before it already reaches top_p; the most likely always stays
        drop_sorted = (probs.cumsum(dim=-1) - probs) >= params.top_p
        drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


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


def sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
) -> torch.Tensor:
    """logits: (B, V) -> next token ids (B,) on the CPU."""
    import torch

    logits = logits.float()
    out = greedy_tokens(logits).cpu()  # (B,)
    for b, (p, gen) in enumerate(zip(params, generators, strict=True)):
        if p.greedy:
            continue
        # shift first: with a tiny temperature, logits / T overflows to +inf and softmax gives NaN;
        # shifted logits are <= 0, so they can only underflow to -inf (the argmax stays at 0)
        row = _filter((logits[b] - logits[b].max()) / p.temperature, p)
        probs = torch.softmax(row, dim=-1)
        out[b] = torch.multinomial(probs, 1, generator=gen).item()
    return out
