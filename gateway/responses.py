"""Our generation outputs in OpenAI's response shapes: text_completion and chat.completion, their
streamed chunks, log-probabilities in each API's form, and usage."""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from typing import Any

from gateway.chat_output import ChatOutput
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


def vllm_prompt_logprobs(o: generation_pb2.GenerationOutput) -> list[dict[str, Any] | None]:
    """vLLM's prompt_logprobs: per prompt token, None for the first, then {token id: {logprob,
    decoded_token}} for the token and the most likely ones there."""
    out: list[dict[str, Any] | None] = [None]
    for lp in o.prompt_logprobs:
        entry = {str(lp.token_id): {"logprob": lp.logprob, "decoded_token": lp.token}}
        for t, v, text in zip(lp.top_token_ids, lp.top_logprobs, lp.top_tokens, strict=False):
            entry.setdefault(str(t), {"logprob": v, "decoded_token": text})
        out.append(entry)
    return out


def _echoed(o: generation_pb2.GenerationOutput, logprobs: bool, scoring: bool) -> tuple[str, dict[str, Any] | None]:
    """The text and logprobs of a choice with echo: the prompt's, then (unless scoring, max_tokens 0)
    the output's; the prompt's first token has no log-probability (null), as OpenAI returns it."""
    text = o.prompt_text if scoring else o.prompt_text + o.text
    if not logprobs:
        return text, None
    prompt = completion_logprobs(o.prompt_logprobs, len(o.prompt_tokens[0]) if o.prompt_tokens else 0)
    first = o.prompt_tokens[0] if o.prompt_tokens else ""
    lps: dict[str, Any] = {
        "tokens": [first, *prompt["tokens"]],
        "token_logprobs": [None, *prompt["token_logprobs"]],
        "top_logprobs": [None, *prompt["top_logprobs"]],
        "text_offset": [0, *prompt["text_offset"]],
    }
    if not scoring:
        end = len(o.prompt_text)
        gen = completion_logprobs(o.logprobs, end)
        for key in lps:
            lps[key].extend(gen[key])
    return text, lps


def completion(
    rid: str,
    model: str,
    outputs: Sequence[generation_pb2.GenerationOutput],
    n: int,
    logprobs: bool,
    *,
    echo: bool = False,
    scoring: bool = False,
    prompt_logprobs: bool = False,
) -> dict[str, Any]:
    """`echo`: the prompt's text (and logprobs) before the output's; `scoring` (max_tokens 0): the
    prompt's alone, the one token generated left out; `prompt_logprobs`: vLLM's field of that name."""
    choices = []
    for i, o in enumerate(outputs):
        if echo:
            text, lps = _echoed(o, logprobs, scoring)
        else:
            text, lps = o.text, completion_logprobs(o.logprobs) if logprobs else None
        choice = {"index": i, "text": text, "logprobs": lps, "finish_reason": FINISH.get(o.finish_reason)}
        if scoring:
            choice["finish_reason"] = "length"
        if prompt_logprobs:
            choice["prompt_logprobs"] = vllm_prompt_logprobs(o)
        choices.append(choice)
    body = {"id": rid, "object": "text_completion", "created": now(), "model": model, "choices": choices}
    body["usage"] = usage(outputs, n)
    if scoring:
        prompt_tokens = body["usage"]["prompt_tokens"]
        body["usage"] = {"prompt_tokens": prompt_tokens, "completion_tokens": 0, "total_tokens": prompt_tokens}
    return body


def chat_completion(
    rid: str,
    model: str,
    outputs: Sequence[generation_pb2.GenerationOutput],
    logprobs: int | None,
    shapes: Sequence[ChatOutput] | None = None,
) -> dict[str, Any]:
    """`shapes`: per choice, its answer's reasoning and tool calls parsed out (gateway/chat_output.py)."""
    choices = []
    for i, o in enumerate(outputs):
        finish = FINISH.get(o.finish_reason)
        if shapes is None:
            message: dict[str, Any] = {"role": "assistant", "content": o.text}
        else:
            message = shapes[i].message(o.text)
            if shapes[i].called and finish == "stop":
                finish = "tool_calls"
        choices.append(
            {
                "index": i,
                "message": message,
                "logprobs": chat_logprobs(o.logprobs, logprobs) if logprobs is not None else None,
                "finish_reason": finish,
            }
        )
    body = {"id": rid, "object": "chat.completion", "created": now(), "model": model, "choices": choices}
    body["usage"] = usage(outputs, len(outputs))
    return body


def chunk(rid: str, model: str, chat: bool, choices: list[dict[str, Any]], created: int) -> dict[str, Any]:
    kind = "chat.completion.chunk" if chat else "text_completion"
    return {"id": rid, "object": kind, "created": created, "model": model, "choices": choices}
