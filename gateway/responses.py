"""Our generation outputs in OpenAI's response shapes: text_completion and chat.completion, their
streamed chunks, log-probabilities in each API's form, and usage."""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from typing import Any

from moe_lightning.api.common.v1 import common_pb2
from moe_lightning.api.generation.v1 import generation_pb2

FINISH = {
    generation_pb2.FINISH_REASON_EOS: "stop",
    generation_pb2.FINISH_REASON_STOP: "stop",
    generation_pb2.FINISH_REASON_LENGTH: "length",
}


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def usage(outputs: Sequence[generation_pb2.GenerationOutput], n: int) -> dict[str, int]:
    """A prompt's tokens count once however many choices it has (choices i*n .. i*n+n-1 share it)."""
    prompt = sum(o.usage.prompt_tokens for i, o in enumerate(outputs) if i % n == 0)
    completion = sum(o.usage.completion_tokens for o in outputs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def completion_logprobs(lps: Sequence[common_pb2.TokenLogprobs], offset: int = 0) -> dict[str, Any]:
    """The completions API's form; `offset`: where this piece's text starts in the choice's text."""
    tokens, offsets = [], []
    for lp in lps:
        offsets.append(offset)
        tokens.append(lp.token)
        offset += len(lp.token)
    return {
        "tokens": tokens,
        "token_logprobs": [lp.logprob for lp in lps],
        "top_logprobs": [dict(zip(lp.top_tokens, lp.top_logprobs, strict=False)) for lp in lps],
        "text_offset": offsets,
    }


def _entry(token: str, logprob: float) -> dict[str, Any]:
    return {"token": token, "logprob": logprob, "bytes": list(token.encode())}


def chat_logprobs(lps: Sequence[common_pb2.TokenLogprobs], top: int) -> dict[str, Any]:
    """The chat API's form: each token with its `top` most likely alternatives."""
    return {
        "content": [
            {
                **_entry(lp.token, lp.logprob),
                "top_logprobs": [
                    _entry(t, v) for t, v in list(zip(lp.top_tokens, lp.top_logprobs, strict=False))[:top]
                ],
            }
            for lp in lps
        ]
    }


def completion(
    rid: str, model: str, outputs: Sequence[generation_pb2.GenerationOutput], n: int, logprobs: bool
) -> dict[str, Any]:
    return {
        "id": rid,
        "object": "text_completion",
        "created": now(),
        "model": model,
        "choices": [
            {
                "index": i,
                "text": o.text,
                "logprobs": completion_logprobs(o.logprobs) if logprobs else None,
                "finish_reason": FINISH.get(o.finish_reason),
            }
            for i, o in enumerate(outputs)
        ],
        "usage": usage(outputs, n),
    }


def chat_completion(
    rid: str, model: str, outputs: Sequence[generation_pb2.GenerationOutput], logprobs: int | None
) -> dict[str, Any]:
    return {
        "id": rid,
        "object": "chat.completion",
        "created": now(),
        "model": model,
        "choices": [
            {
                "index": i,
                "message": {"role": "assistant", "content": o.text},
                "logprobs": chat_logprobs(o.logprobs, logprobs) if logprobs is not None else None,
                "finish_reason": FINISH.get(o.finish_reason),
            }
            for i, o in enumerate(outputs)
        ],
        "usage": usage(outputs, len(outputs)),
    }


def chunk(rid: str, model: str, chat: bool, choices: list[dict[str, Any]], created: int) -> dict[str, Any]:
    kind = "chat.completion.chunk" if chat else "text_completion"
    return {"id": rid, "object": kind, "created": created, "model": model, "choices": choices}
