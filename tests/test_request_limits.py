"""moe_lightning.validation's size limits (issue 14, items 6 and 7): stop strings, request_id, and a
response that could never be sent, refused at submit with what is allowed (test_validation.py style)."""

from __future__ import annotations

import grpc
import pytest

from moe_lightning.request import GenerationRequest, InvalidRequestError
from moe_lightning.sampling import SamplingParams
from moe_lightning.service.errors import ResourceExhaustedError, status_for
from moe_lightning.service.runtime import MAX_MESSAGE_BYTES
from moe_lightning.validation import (
    MAX_REQUEST_ID_CHARS,
    MAX_STOP_CHARS,
    MAX_STOP_TOTAL_CHARS,
    RequestLimits,
    check_batch,
    response_bytes,
    validate,
)

# a server's limits: 32k vocabulary (3-byte token ids), a long context, the API's 64 MiB send limit
SERVER = RequestLimits(vocab_size=32000, max_context=1 << 20, max_response_bytes=MAX_MESSAGE_BYTES)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"stop": ("x" * (MAX_STOP_CHARS + 1),)},
            f"stop string 0 has {MAX_STOP_CHARS + 1} characters; each may have at most {MAX_STOP_CHARS}",
        ),
        (
            {"stop": ("a", "b" * 1_000_000)},
            f"stop string 1 has 1000000 characters; each may have at most {MAX_STOP_CHARS}",
        ),
        (
            {"stop": ("y" * MAX_STOP_CHARS,) * 5},
            f"the stop strings have {5 * MAX_STOP_CHARS} characters in all; at most {MAX_STOP_TOTAL_CHARS} are allowed",
        ),
        (
            {"request_id": "r" * (MAX_REQUEST_ID_CHARS + 1)},
            f"request_id has {MAX_REQUEST_ID_CHARS + 1} characters; at most {MAX_REQUEST_ID_CHARS} are allowed",
        ),
    ],
)
def test_oversized_stops_and_request_ids_are_invalid(kwargs: dict, message: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        validate(GenerationRequest([1, 2], 8, **kwargs), SERVER)
    assert str(info.value) == message
    assert status_for(info.value) == grpc.StatusCode.INVALID_ARGUMENT


def test_stops_and_request_ids_at_their_limits_pass() -> None:
    stops = ("s" * MAX_STOP_CHARS,) * (MAX_STOP_TOTAL_CHARS // MAX_STOP_CHARS)
    validate(GenerationRequest([1, 2], 8, stop=stops, request_id="r" * MAX_REQUEST_ID_CHARS), SERVER)


def _logprobs(n: int, max_new: int, k: int) -> list[GenerationRequest]:
    return [GenerationRequest([1, 2], max_new, SamplingParams(logprobs=k)) for _ in range(n)]


def test_a_batch_whose_response_cannot_be_sent_is_refused_before_it_runs() -> None:
    """The issue's case: 1,024 x 512 tokens with 20 logprobs came to 82 MiB and ended RESOURCE_EXHAUSTED
    only after all of it was computed."""
    batch = _logprobs(1024, 512, 20)
    for r in batch:
        validate(r, SERVER)  # each alone fits
    with pytest.raises(ResourceExhaustedError) as info:
        check_batch(batch, SERVER)
    assert status_for(info.value) == grpc.StatusCode.RESOURCE_EXHAUSTED
    message = str(info.value)
    assert message.startswith("the response to these 1024 prompts would be about ")
    assert "more than the 64 MiB one response may carry" in message and "lower max_new_tokens or logprobs" in message
    # the estimate is of the right size: the real response was 82 MiB
    assert 75 * 2**20 < sum(response_bytes(r, SERVER.vocab_size) for r in batch) < 95 * 2**20
    check_batch(_logprobs(1024, 512, 0), SERVER)  # the same without logprobs: ~4 MiB
    check_batch(_logprobs(48, 512, 20), SERVER)  # within the log-probabilities' bound too (~2 MiB)


def test_one_response_too_large_is_refused_by_validate() -> None:
    with pytest.raises(ResourceExhaustedError, match="the response would be about .* MiB, more than the 64 MiB"):
        validate(GenerationRequest([1], 500_000, SamplingParams(logprobs=20)), SERVER)


def test_without_a_message_limit_nothing_is_refused_for_size() -> None:
    engine = RequestLimits(vocab_size=32000, max_context=1 << 20)  # the in-process engine: no gRPC message
    validate(GenerationRequest([1], 500_000, SamplingParams(logprobs=20)), engine)
    check_batch(_logprobs(1024, 512, 20), engine)
