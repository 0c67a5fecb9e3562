"""Every check a generation request gets, in one place, each with the message that says what is allowed.

The public API runs them all before it queues a request (so the scheduler can trust what it is given),
and the in-process engine runs the ones that apply to it. This lives in moe_lightning rather than in
the orchestrator because the engine and the `generate` command (`validate` against
`RequestLimits.of(spec)`, the model's own limits) must refuse exactly what the server refuses, and
moe_lightning never imports the orchestrator.

Refusals are InvalidRequestError (INVALID_ARGUMENT: the request itself is wrong) or, when a valid
request is more than this server's KV cache can ever hold or its response more than one gRPC message
may carry, ResourceExhaustedError (RESOURCE_EXHAUSTED: the status gRPC itself gives a message over the
size limit, which such a request used to end with, after all its work was done).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from moe_lightning.kv_layout import KVLayout
from moe_lightning.request import GenerationRequest, InvalidRequestError
from moe_lightning.sampling import SamplingParams
from moe_lightning.service.errors import ResourceExhaustedError
from moe_lightning.spec import ModelSpec
from moe_lightning.tokenizer import TextTokenizer

MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256  # one stop string; bounds the text held back from a stream and the matcher's tables
MAX_STOP_TOTAL_CHARS = 1024  # all of a request's stop strings together
MAX_REQUEST_ID_CHARS = 256  # it is echoed in every response and log line of the request
# Text is refused unread past --max-prefill-tokens x this many UTF-8 bytes: no tokenizer turns more text
# into that few tokens in practice (English and code average about 4 bytes a token, CJK 3 or less; the
# longest whitespace and punctuation runs of common vocabularies are 16), and encoding text costs time
# that grows faster than its length while holding the GIL (8 MiB took 21 s), so it must not start.
MAX_TEXT_BYTES_PER_TOKEN = 8
PREFILL_BOUND = "--max-prefill-tokens"  # the orchestrator's bound on a prompt; the gateway's is the context
CONTEXT_BOUND = "the model's context"
# inputs of one BatchGenerate (GetServerMetadata.max_batch_prompts); the gateway bounds a request's
# prompts x n choices by it too, streamed or not, so that no body fans out without a bound
MAX_BATCH_PROMPTS = 1024
# what one input carries besides its prompt: request_id, stop strings, sampling fields
INPUT_OVERHEAD_BYTES = 4096
# Response size estimate (protobuf wire bytes): per request, the fields besides token ids, text and
# logprobs (request_id aside; usage, timings, finish reason, tags and lengths); per generated token,
# its text (a typical 4 bytes: a token's longest text would refuse ordinary batches) and, with k
# logprobs, a TokenLogprobs of 2 ids and 1 float plus k ids and k floats with their tags and lengths
RESPONSE_OVERHEAD_BYTES = 96
TEXT_BYTES_PER_TOKEN = 4
LOGPROBS_ENTRY_BYTES = 16
# Log-probabilities one response may carry (a call's prompts together; each prompt position or generated
# token is its token's and its top k's): what the gateway makes of each is about 64 bytes of JSON and
# ~280 of Python objects, whatever the protobuf holds (~7). 256 prompts of 1,023 ids with prompt_logprobs
# 20 passed the 64 MiB message bound at 60.5 MB and became 324 MB of JSON, the gateway 3.6 GB, and both
# health checks failed for the 72 s it took (issue 54); this bound is ~32 MiB of JSON
MAX_RESPONSE_LOGPROBS = 1 << 19
JSON_LOGPROB_BYTES = 64
STOP_NEEDS_TOKENIZER = (
    "stop strings need the model's tokenizer.json to decode the output, and this model has none: "
    "send no stop strings (or serve a checkpoint with a tokenizer)"
)


@dataclass(frozen=True, slots=True)
class RequestLimits:
    """What a request is checked against. None means the caller has no such limit of its own (the
    in-process engine admits any prompt length and sizes its KV cache for the requests it is given)."""

    vocab_size: int
    max_context: int  # prompt + max_new_tokens, the model's max_position_embeddings
    has_tokenizer: bool = True  # False refuses stop strings: nothing could decode the output to match them
    max_prompt_tokens: int | None = None  # the server's --max-prefill-tokens
    kv_blocks: int | None = None  # the server's whole KV cache, in blocks
    kv_layout: KVLayout = field(default_factory=KVLayout)  # how a sequence's tokens take those blocks (kv_layout.py)
    max_response_bytes: int | None = None  # the API's max send message size (one response, one batch)

    @classmethod
    def of(
        cls,
        spec: ModelSpec,
        *,
        has_tokenizer: bool = True,
        max_prompt_tokens: int | None = None,
        kv_blocks: int | None = None,
        kv_layout: KVLayout | None = None,
        max_response_bytes: int | None = None,
    ) -> RequestLimits:
        return cls(
            spec.vocab_size,
            spec.max_position_embeddings,
            has_tokenizer,
            max_prompt_tokens,
            kv_blocks,
            kv_layout or KVLayout(),
            max_response_bytes,
        )


def max_text_bytes(max_prompt_tokens: int) -> int:
    """The longest prompt text (UTF-8 bytes) a server accepting `max_prompt_tokens` tokens reads."""
    return max_prompt_tokens * MAX_TEXT_BYTES_PER_TOKEN


def check_text_size(text: str, max_prompt_tokens: int | None, bound: str = PREFILL_BOUND) -> None:
    """Refuses text no legal prompt could be, before anything reads it (len() is O(1); a character is at
    least one byte, so only text under the bound in characters is measured in bytes). `bound` names where
    `max_prompt_tokens` comes from, for the message."""
    if max_prompt_tokens is None:
        return
    limit = max_text_bytes(max_prompt_tokens)
    if len(text) > limit or len(text.encode("utf-8", "surrogatepass")) > limit:
        raise InvalidRequestError(
            f"prompt text is longer than any accepted prompt: at most {limit} bytes of UTF-8 "
            f"({max_prompt_tokens} tokens, {bound}, x {MAX_TEXT_BYTES_PER_TOKEN} bytes a token); "
            "send a shorter prompt"
        )


def check_conversation_size(contents: Sequence[str], max_prompt_tokens: int | None, bound: str = PREFILL_BOUND) -> None:
    """Refuses a conversation no legal prompt could be, before it is rendered or tokenized: each message's
    content and all of them together within the text bound of one prompt, and no more messages than the
    prompt has tokens (every template writes at least one token per message: its role marker)."""
    if max_prompt_tokens is None:
        return
    if len(contents) > max_prompt_tokens:
        raise InvalidRequestError(
            f"the conversation has {len(contents)} messages; a prompt of at most {max_prompt_tokens} tokens "
            f"({bound}) holds fewer: send fewer messages"
        )
    limit = max_text_bytes(max_prompt_tokens)
    total = 0
    for content in contents:
        check_text_size(content, max_prompt_tokens, bound)
        total += len(content)
        if total > limit:
            break
    if total > limit or sum(len(c.encode("utf-8", "surrogatepass")) for c in contents) > limit:
        raise InvalidRequestError(
            f"the conversation's messages are longer than any accepted prompt: at most {limit} bytes of UTF-8 "
            f"in all ({max_prompt_tokens} tokens, {bound}, x {MAX_TEXT_BYTES_PER_TOKEN} bytes a "
            "token); send a shorter conversation"
        )


def check_prompt_length(n: int, limits: RequestLimits) -> None:
    """Refuses a prompt of `n` tokens over --max-prefill-tokens. The API calls it on the count of the
    ids a client sent (len() of a protobuf repeated field is O(1)) before they become a list and are
    scanned: 26 M ids, within the receive limit, cost 3 s and 640 MB to refuse after that."""
    if limits.max_prompt_tokens is not None and n > limits.max_prompt_tokens:
        raise InvalidRequestError(
            f"prompt has {n} tokens; this server accepts at most {limits.max_prompt_tokens} (--max-prefill-tokens)"
        )


def prompt_ids(text: str | None, token_ids: Sequence[int] | None, tokenizer: TextTokenizer | None) -> list[int]:
    """The prompt from whichever of text / token_ids the client set (None: not set)."""
    if text is not None:
        if tokenizer is None:
            raise InvalidRequestError("this model has no tokenizer: send token_ids instead of text")
        if not text:
            raise InvalidRequestError("prompt is empty: give text or at least one token id")
        return tokenizer.encode(text)
    if token_ids is not None:
        return list(token_ids)
    raise InvalidRequestError("prompt is missing: set text or token_ids")


def sampling_params(
    temperature: float, top_k: int, top_p: float, seed: int | None, logprobs: int, **controls: Any
) -> SamplingParams:
    """SamplingParams holds the one definition of what is allowed; a client's bad value is its error.
    `controls`: its other fields (penalties, logit_bias, min_tokens, stop_token_ids, prompt_logprobs)."""
    try:
        return SamplingParams(temperature, top_k, top_p, seed, logprobs, **controls)
    except ValueError as exc:
        raise InvalidRequestError(str(exc)) from None


def _check_sampling_tokens(request: GenerationRequest, limits: RequestLimits) -> None:
    """What SamplingParams cannot check alone: token ids in the vocabulary, min_tokens within the budget,
    and a grammar's demands."""
    p = request.sampling
    for name, ids in (("logit_bias", [t for t, _ in p.logit_bias]), ("stop_token_ids", p.stop_token_ids)):
        bad = [t for t in ids if t >= limits.vocab_size]
        if bad:
            raise InvalidRequestError(
                f"{name} token ids {bad[:5]} are outside the vocabulary; allowed: 0..{limits.vocab_size - 1}"
            )
    if p.min_tokens > request.max_new_tokens:
        raise InvalidRequestError(
            f"min_tokens ({p.min_tokens}) must be at most max_new_tokens ({request.max_new_tokens})"
        )
    if request.grammar is not None:
        if request.ignore_eos:
            raise InvalidRequestError("ignore_eos cannot be combined with a grammar: the output ends where it does")
        if not limits.has_tokenizer:
            raise InvalidRequestError("structured output needs the model's tokenizer.json, and this model has none")
    if request.echo and not limits.has_tokenizer:
        raise InvalidRequestError("echo needs the model's tokenizer.json to decode the prompt, and this model has none")


def blocks_needed(request: GenerationRequest, layout: KVLayout) -> int:
    """KV blocks reserved at admission: the whole budget, so a running request never finds the cache full."""
    return layout.blocks_for(len(request.prompt_ids) + request.max_new_tokens)


def check_kv(request: GenerationRequest, kv_blocks: int, layout: KVLayout) -> int:
    """Returns the request's KV blocks; refuses one that could never be admitted (it would wait forever)."""
    blocks = blocks_needed(request, layout)
    if blocks > kv_blocks:
        tokens = len(request.prompt_ids) + request.max_new_tokens
        groups = f" in {layout.num_groups} layer groups" if layout.num_groups > 1 else ""
        raise ResourceExhaustedError(
            f"prompt + max_new_tokens is {tokens} tokens, {blocks} KV blocks of {layout.block_size} tokens{groups}; "
            f"the cache holds {layout.tokens_in(kv_blocks)} tokens ({kv_blocks} blocks) in all"
        )
    return blocks


def _varint_bytes(value: int) -> int:
    return max(1, -(-max(value, 1).bit_length() // 7))


def response_bytes(request: GenerationRequest, vocab_size: int) -> int:
    """An estimate of the wire size of the request's GenerationOutput at its full max_new_tokens: the
    token ids and logprobs at their largest, the text at a typical size per token."""
    id_bytes = _varint_bytes(vocab_size - 1)
    k = request.sampling.logprobs
    per_token = id_bytes + TEXT_BYTES_PER_TOKEN
    if k:
        per_token += LOGPROBS_ENTRY_BYTES + 2 * id_bytes + k * (id_bytes + 4)
    total = RESPONSE_OVERHEAD_BYTES + len(request.request_id.encode()) + request.max_new_tokens * per_token
    prompt_k = request.sampling.prompt_logprobs
    if prompt_k is not None:  # an entry per prompt token, with its text
        entry = (
            LOGPROBS_ENTRY_BYTES
            + 2 * id_bytes
            + TEXT_BYTES_PER_TOKEN
            + prompt_k * (id_bytes + 4 + TEXT_BYTES_PER_TOKEN)
        )
        total += len(request.prompt_ids) * entry
    if request.echo:
        total += len(request.prompt_ids) * TEXT_BYTES_PER_TOKEN
    return total


def logprob_entries(request: GenerationRequest) -> int:
    """The log-probabilities the request's response carries at most: per generated token with
    logprobs k, and per prompt position with prompt_logprobs k, the token's own and the top k."""
    p = request.sampling
    entries = request.max_new_tokens * (p.logprobs + 1) if p.logprobs else 0
    if p.prompt_logprobs is not None:
        entries += len(request.prompt_ids) * (p.prompt_logprobs + 1)
    return entries


def check_logprobs(entries: int, what: str) -> None:
    """Refuses a response of more than MAX_RESPONSE_LOGPROBS log-probabilities, before any work."""
    if entries > MAX_RESPONSE_LOGPROBS:
        raise InvalidRequestError(
            f"{what} would carry {entries} log-probabilities (prompt tokens x (prompt_logprobs + 1) + max_new_tokens "
            f"x (logprobs + 1)); one response carries at most {MAX_RESPONSE_LOGPROBS} (about "
            f"{MAX_RESPONSE_LOGPROBS * JSON_LOGPROB_BYTES >> 20} MiB of JSON): ask for fewer, or send fewer or "
            "shorter prompts per call"
        )


def _check_response(total: int, limit: int, what: str) -> None:
    if total > limit:
        raise ResourceExhaustedError(
            f"{what} would be about {total / 2**20:.1f} MiB, more than the {limit / 2**20:.0f} MiB one response may "
            "carry: lower max_new_tokens or logprobs, or send fewer prompts per call"
        )


def check_batch(requests: Sequence[GenerationRequest], limits: RequestLimits) -> None:
    """BatchGenerate returns every output in one message: refuses a batch whose response could not be sent
    (each request was validated on its own already), or whose log-probabilities are more than one
    response carries (the API's bounds: none without a message limit, as in process). RESOURCE_EXHAUSTED
    or INVALID_ARGUMENT, before any of it runs."""
    if limits.max_response_bytes is None:
        return
    what = f"the response to these {len(requests)} prompts"
    _check_response(sum(response_bytes(r, limits.vocab_size) for r in requests), limits.max_response_bytes, what)
    check_logprobs(sum(logprob_entries(r) for r in requests), what)


def _check_stops(stops: Sequence[str]) -> None:
    if len(stops) > MAX_STOP_STRINGS or any(not s for s in stops):
        raise InvalidRequestError(f"stop takes at most {MAX_STOP_STRINGS} non-empty strings")
    for i, stop in enumerate(stops):
        if len(stop) > MAX_STOP_CHARS:
            raise InvalidRequestError(
                f"stop string {i} has {len(stop)} characters; each may have at most {MAX_STOP_CHARS}"
            )
    total = sum(len(s) for s in stops)
    if total > MAX_STOP_TOTAL_CHARS:
        raise InvalidRequestError(
            f"the stop strings have {total} characters in all; at most {MAX_STOP_TOTAL_CHARS} are allowed"
        )


def validate(request: GenerationRequest, limits: RequestLimits) -> None:
    """Raises InvalidRequestError or ResourceExhaustedError for a request that cannot be served."""
    n = len(request.prompt_ids)
    if not n:
        raise InvalidRequestError("prompt is empty: give at least one token")
    bad = [t for t in request.prompt_ids if not 0 <= t < limits.vocab_size]
    if bad:
        raise InvalidRequestError(
            f"prompt token ids {bad[:5]} are outside the vocabulary; allowed: 0..{limits.vocab_size - 1}"
        )
    if request.max_new_tokens <= 0:
        raise InvalidRequestError(f"max_new_tokens must be >= 1, got {request.max_new_tokens}")
    total = n + request.max_new_tokens
    if total > limits.max_context:
        raise InvalidRequestError(
            f"prompt ({n} tokens) + max_new_tokens ({request.max_new_tokens}) = {total} "
            f"exceeds the model's context of {limits.max_context} tokens"
        )
    _check_stops(request.stop)
    _check_sampling_tokens(request, limits)
    if request.stop and not limits.has_tokenizer:
        raise InvalidRequestError(STOP_NEEDS_TOKENIZER)
    check_prompt_length(n, limits)
    if len(request.request_id) > MAX_REQUEST_ID_CHARS:
        raise InvalidRequestError(
            f"request_id has {len(request.request_id)} characters; at most {MAX_REQUEST_ID_CHARS} are allowed"
        )
    if limits.kv_blocks is not None:
        check_kv(request, limits.kv_blocks, limits.kv_layout)
    if limits.max_response_bytes is not None:
        _check_response(response_bytes(request, limits.vocab_size), limits.max_response_bytes, "the response")
        check_logprobs(logprob_entries(request), "the response")
