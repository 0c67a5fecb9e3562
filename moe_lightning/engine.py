"""In-process generation: every stage in one process, over a local paged KV cache.

This is the reference path the services are checked against, and the baseline the stack's
benchmark compares with. It composes the same stage functions the services run.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from moe_lightning.kv_cache import PagedKVCache
from moe_lightning.kv_layout import KVLayout
from moe_lightning.logits_processors import process_logits
from moe_lightning.output_text import OutputText
from moe_lightning.request import GenerationRequest, GenerationResult, InvalidRequestError
from moe_lightning.sampling import NOT_FINITE, SequenceSampler, sample
from moe_lightning.spec import ModelSpec
from moe_lightning.stages import (
    AttentionMetadata,
    attend,
    embed_tokens,
    head_logits,
    plan_batch,
    post_attention,
    pre_attention,
)
from moe_lightning.tokenizer import TextTokenizer
from moe_lightning.validation import RequestLimits, blocks_needed, validate
from moe_lightning.weights import ModelWeights

# (step, indices of the requests in this batch, their logits (B, V)) -> None
LogitsHook = Callable[[int, list[int], torch.Tensor], None]


@dataclass(slots=True)
class GenerationStats:
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    decode_steps: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    decode_tokens: int = 0  # tokens produced by decode steps (excludes the one from prefill)

    @property
    def total_seconds(self) -> float:
        return self.prefill_seconds + self.decode_seconds

    def to_dict(self) -> dict[str, float]:
        total = self.total_seconds
        return {
            "prefill_seconds": self.prefill_seconds,
            "decode_seconds": self.decode_seconds,
            "decode_steps": self.decode_steps,
            "prompt_tokens": self.prompt_tokens,
            "generated_tokens": self.generated_tokens,
            "generated_tokens_per_second": self.generated_tokens / total if total else 0.0,
            "decode_tokens_per_second": self.decode_tokens / self.decode_seconds if self.decode_seconds else 0.0,
        }


@dataclass(slots=True)
class _Sequence:
    index: int
    request: GenerationRequest
    output: OutputText  # its token ids, finish reason and text
    sampler: SequenceSampler  # its parameters and random stream


def forward_step(
    spec: ModelSpec,
    weights: ModelWeights,
    cache: PagedKVCache,
    tokens: torch.Tensor,
    meta: AttentionMetadata,
    every_position: bool = False,
) -> torch.Tensor:
    """Runs all layers for a ragged batch; tokens: (T,) -> logits of each sequence's last token (B, V),
    or of every token (T, V) with `every_position` (scoring a text)."""
    positions = meta.positions().to(tokens.device)  # (T,)
    plans = plan_batch(spec, meta, tokens.device)
    hidden = embed_tokens(weights.embed, tokens)  # (T, D)
    for i, layer in enumerate(weights.layers):
        q, k, v = pre_attention(spec, layer, hidden, positions)
        attn = attend(spec, q, k, v, *cache.layer(i), plans[i], layer.sinks)  # (T, H * Hd)
        hidden, _ = post_attention(spec, layer, hidden, attn)
    if every_position:
        return head_logits(spec, weights.final_norm, weights.lm_head, hidden)
    last = torch.tensor(meta.q_lens).cumsum(0) - 1  # (B,) row of each sequence's last token
    return head_logits(spec, weights.final_norm, weights.lm_head, hidden[last.to(hidden.device)])


class InProcessEngine:
    def __init__(
        self,
        spec: ModelSpec,
        weights: ModelWeights,
        tokenizer: TextTokenizer | None = None,
        block_size: int = 16,
        device: torch.device | str = "cpu",
        kv_shuffle_seed: int | None = None,
        kv_dtype: torch.dtype | str | None = None,
    ) -> None:
        """`kv_dtype`: the KV cache's format (a float dtype, or "int8" as cpu_attention's --kv-dtype int8);
        default the weights' dtype."""
        self.spec = spec
        self.weights = weights
        self.tokenizer = tokenizer
        self.block_size = block_size
        self.device = torch.device(device)
        self.dtype = weights.embed.dtype
        self.kv_shuffle_seed = kv_shuffle_seed
        self.kv_dtype = self.dtype if kv_dtype is None else kv_dtype

    @torch.inference_mode()
    def generate(
        self, requests: Sequence[GenerationRequest], on_logits: LogitsHook | None = None
    ) -> tuple[list[GenerationResult], GenerationStats]:
        # no prompt or KV limit of its own: the cache below is sized for these requests
        limits = RequestLimits.of(self.spec, has_tokenizer=self.tokenizer is not None)
        for r in requests:
            validate(r, limits)
            if r.grammar is not None or r.echo or r.sampling.prompt_logprobs is not None:
                raise InvalidRequestError(
                    "the in-process engine takes no grammar, echo or prompt_logprobs: serve the model (up) for them"
                )
        seqs = [
            _Sequence(
                i,
                r,
                OutputText(r, self.spec.eos_token_ids, self.tokenizer),
                SequenceSampler.start(r.sampling, prompt_len=len(r.prompt_ids)),
            )
            for i, r in enumerate(requests)
        ]
        for s in seqs:
            s.sampler.feed(0, s.request.prompt_ids)
        layout = KVLayout.of(self.spec, self.block_size)
        blocks = sum(blocks_needed(r, layout) for r in requests)
        cache = PagedKVCache(
            self.spec, max(blocks, 1), self.block_size, self.kv_dtype, self.device, self.kv_shuffle_seed
        )
        stats = GenerationStats(prompt_tokens=sum(len(r.prompt_ids) for r in requests))
        active = seqs
        t0 = time.perf_counter()
        meta = cache.append([s.index for s in active], [len(s.request.prompt_ids) for s in active])
        tokens = torch.tensor([t for s in active for t in s.request.prompt_ids], device=self.device)
        logits = forward_step(self.spec, self.weights, cache, tokens, meta)
        step = 0
        while True:
            if on_logits is not None:
                on_logits(step, [s.index for s in active], logits)
            samplers = [s.sampler for s in active]
            processed = process_logits(logits, samplers, self.spec.eos_token_ids)  # penalties, bias, min_tokens
            next_ids = sample(processed, [p.params for p in samplers], [p.next_key() for p in samplers]).tolist()
            if NOT_FINITE in next_ids:  # the reference path has no sequence to end alone: say which one
                bad = active[next_ids.index(NOT_FINITE)].index
                raise ValueError(f"the logits of request {bad} are not finite (NaN or inf) at step {step}")
            for s, tok in zip(active, next_ids, strict=True):
                s.sampler.feed(len(s.request.prompt_ids) + len(s.output.token_ids), [tok])
                _, reason = s.output.append(tok)  # no stream: the text is read at the end
                if reason is not None:
                    cache.free(s.index)
            now = time.perf_counter()
            if step == 0:
                stats.prefill_seconds = now - t0
            else:
                stats.decode_seconds += now - t0
                stats.decode_steps += 1
                stats.decode_tokens += len(active)
            active = [s for s in active if s.output.finish_reason is None]
            if not active:
                break
            t0 = time.perf_counter()
            meta = cache.append([s.index for s in active], [1] * len(active))
            tokens = torch.tensor([s.output.token_ids[-1] for s in active], device=self.device)
            logits = forward_step(self.spec, self.weights, cache, tokens, meta)
            step += 1
        results = [
            GenerationResult(
                token_ids=s.output.token_ids,
                text=s.output.final_text,
                finish_reason=s.output.finish_reason or "",
                prompt_tokens=len(s.request.prompt_ids),
            )
            for s in seqs
        ]
        stats.generated_tokens = sum(len(s.output.token_ids) for s in seqs)
        return results, stats
