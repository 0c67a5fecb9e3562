"""Issue 54's bounds at the API edge, in process (the real app over a recording upstream, and
moe_lightning.validation): sampling controls within ranges whose arithmetic stays finite, numbers
that are not booleans, OpenAI's rules for metadata and tool names, list lengths counted before a body
is modelled, and log-probabilities bounded by the JSON they make. Each bad value is a 400 naming it."""

from __future__ import annotations

import json
import time
from typing import Any

import grpc
import pytest
from test_gateway_fields import RecordingUpstream, chat, completion, post, refused

from gateway.bounds import MAX_MESSAGES, MAX_METADATA_KEYS, MAX_TOOLS
from moe_lightning.api.generation.v1 import generation_pb2
from moe_lightning.commands.openai_batch import _parse
from moe_lightning.request import GenerationRequest, InvalidRequestError
from moe_lightning.sampling import SamplingParams
from moe_lightning.service.errors import status_for
from moe_lightning.service.runtime import MAX_MESSAGE_BYTES
from moe_lightning.validation import MAX_RESPONSE_LOGPROBS, RequestLimits, check_batch, validate
from orchestrator.conversation import conversation_from_pb

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
SERVER = RequestLimits(vocab_size=32000, max_context=1 << 20, max_response_bytes=MAX_MESSAGE_BYTES)


def _tool(name: str) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name}}


@pytest.mark.parametrize("value", [1e-45, 0.0099, 2.0001, 1e300])
def test_repetition_penalty_outside_0_01_to_2_is_refused(value: float) -> None:
    """1e-45 divided positive logits to +inf: NaN probabilities, and every request of the step ended."""
    with pytest.raises(ValueError, match=r"repetition_penalty must be in 0\.01\.\.2 \(1 = none\)"):
        SamplingParams(temperature=1.0, repetition_penalty=value)


def test_the_ranges_ends_pass_as_the_fp32_field_carries_them() -> None:
    for value in (0.01, 0.009999999776482582, 2.0):  # 0.01 in a protobuf float is 0.0099999998
        SamplingParams(repetition_penalty=value)


@pytest.mark.parametrize(
    ("route", "fields", "param"),
    [
        (COMPLETIONS, {"max_tokens": True}, "max_tokens"),
        (CHAT, {"max_completion_tokens": True}, "max_completion_tokens"),
        (CHAT, {"n": True}, "n"),
        (CHAT, {"temperature": False}, "temperature"),
        (CHAT, {"seed": True}, "seed"),
        (CHAT, {"top_k": True}, "top_k"),
        (CHAT, {"logprobs": True, "top_logprobs": True}, "top_logprobs"),
        (COMPLETIONS, {"logprobs": True}, "logprobs"),
        (CHAT, {"logit_bias": {"5": True}}, "logit_bias.5"),
        (CHAT, {"stop_token_ids": [True]}, "stop_token_ids.0"),
    ],
)
def test_a_boolean_is_not_a_number(route: str, fields: dict[str, Any], param: str) -> None:
    """`max_tokens: true` was taken as 1 (pydantic's lax mode)."""
    make = completion if route == COMPLETIONS else chat
    assert "a number is expected, got the boolean" in refused(post(route, make(**fields)), param)


@pytest.mark.parametrize(
    ("metadata", "param", "says"),
    [
        ({f"k{i}": "v" for i in range(MAX_METADATA_KEYS + 1)}, "metadata", "17 keys; at most 16"),
        ({f"k{i}": "v" for i in range(100_000)}, "metadata", "100000 keys; at most 16"),
        ({"k" * 65: "v"}, "metadata", "a key has 65 characters; at most 64"),
        ({"k": "v" * 513}, "metadata.k", "513 characters; at most 512"),
        ({"k": 5}, "metadata.k", "must be a string"),
    ],
)
def test_metadata_follows_openais_rule(metadata: dict[str, Any], param: str, says: str) -> None:
    for route, make in ((CHAT, chat), (COMPLETIONS, completion)):
        assert says in refused(post(route, make(metadata=metadata)), param)
    # the Batch API's lines are read by the same models
    line = _parse(json.dumps({"custom_id": "a", "url": CHAT, "body": chat(metadata=metadata)}), 1)
    assert line.error is not None and says in line.error.message and line.error.param == param


def test_metadata_at_its_limits_passes() -> None:
    metadata = {f"{i:064d}": "v" * 512 for i in range(MAX_METADATA_KEYS)}
    assert post(CHAT, chat(metadata=metadata)).status_code == 200


@pytest.mark.parametrize("name", ["", "a" * 65, "a" * 100_000, "get\nweather", "f</tool_call>", "get weather", "é"])
def test_tool_names_follow_openais_rule(name: str) -> None:
    """Tool names were written raw into the template: empty, 100 KB, newlines and `</tool_call>`."""
    upstream = RecordingUpstream(tool_call_format="hermes")
    says = refused(post(CHAT, chat(tools=[_tool("ok"), _tool(name)]), upstream), "tools.1")
    assert "must be 1 to 64 of a-z, A-Z, 0-9, _ and -" in says and len(says) < 300
    call = {"id": "c1", "type": "function", "function": {"name": name, "arguments": "{}"}}
    turns = [*chat()["messages"], {"role": "assistant", "content": None, "tool_calls": [call]}]
    refused(post(CHAT, chat(messages=turns), upstream), "messages.1.tool_calls.0")


@pytest.mark.parametrize("where", ["tools", "history"])
def test_the_grpc_api_checks_tool_names_too(where: str) -> None:
    m = generation_pb2.ChatMessages(messages=[generation_pb2.ChatMessage(role="user", content="hi")])
    if where == "tools":
        m.tools.append(generation_pb2.ToolSpec(name="f</tool_call>"))
    else:
        turn = generation_pb2.ChatMessage(role="assistant", tool_calls=[generation_pb2.ToolCall(id="c", name="a\nb")])
        m.messages.append(turn)
    with pytest.raises(InvalidRequestError, match="function name must be 1 to 64 of a-z, A-Z, 0-9, _ and -"):
        conversation_from_pb(m, None)


def test_a_tool_name_at_the_limit_passes() -> None:
    upstream = RecordingUpstream(tool_call_format="hermes")
    assert post(CHAT, chat(tools=[_tool("A-z_0" * 12 + "abcd")]), upstream).status_code == 200


@pytest.mark.parametrize(
    ("route", "fields", "param", "says"),
    [
        (CHAT, {"messages": [{"role": "user", "content": ""}] * (MAX_MESSAGES + 1)}, "messages", "2049 items"),
        (CHAT, {"tools": [_tool("f")] * (MAX_TOOLS + 1)}, "tools", "129 items; at most 128"),
        (CHAT, {"stop": ["x"] * 17}, "stop", "17 items; at most 16"),
        (CHAT, {"stop_token_ids": [1] * 65}, "stop_token_ids", "65 items; at most 64"),
        (CHAT, {"logit_bias": {str(i): 1 for i in range(1025)}}, "logit_bias", "1025 keys; at most 1024"),
        (COMPLETIONS, {"prompt": ["a"] * 1025}, "prompt", "1025 prompts; one request takes at most 1024"),
        (
            CHAT,
            {"messages": [{"role": "user", "content": [{"type": "text", "text": ""}] * 5000}] * 2},
            "messages",
            "10000 content parts and tool calls in all; at most 8192",
        ),
    ],
)
def test_list_lengths_are_counted_before_the_body_is_modelled(
    route: str, fields: dict[str, Any], param: str, says: str
) -> None:
    make = completion if route == COMPLETIONS else chat
    assert says in refused(post(route, make(**fields)), param)


def test_a_body_of_250000_messages_costs_its_parse_not_its_model() -> None:
    """The count was checked after every message was modelled: 8.3 MB held the event loop ~1.2 s."""
    body = json.dumps(chat(messages=[{"role": "user", "content": ""}] * 250_000)).encode()
    started = time.perf_counter()
    says = refused(post(CHAT, body), "messages")
    took = time.perf_counter() - started
    print(f"MEASURE 250,000 messages refused in {took:.3f} s")
    assert "250000 items; at most 2048" in says and took < 2.0


def test_log_probabilities_are_bounded_by_the_json_they_make() -> None:
    """H4: 256 prompts of 1,023 ids with prompt_logprobs 20 were 60.5 MB of protobuf, under the 64 MiB
    message bound, and 324 MB of JSON. INVALID_ARGUMENT naming the limit, before any of it runs."""
    batch = [GenerationRequest(list(range(1, 1024)), 1, SamplingParams(prompt_logprobs=20)) for _ in range(256)]
    validate(batch[0], SERVER)  # one alone fits
    with pytest.raises(InvalidRequestError) as info:
        check_batch(batch, SERVER)
    assert status_for(info.value) == grpc.StatusCode.INVALID_ARGUMENT
    assert str(info.value).startswith("the response to these 256 prompts would carry 5499648 log-probabilities")
    assert f"at most {MAX_RESPONSE_LOGPROBS} (about 32 MiB of JSON)" in str(info.value)
    check_batch(batch[:24], SERVER)  # 24 x 1,023 x 21 = 515,592: within it
    generated = GenerationRequest([1], 30_000, SamplingParams(logprobs=20))  # the generated ones likewise
    with pytest.raises(InvalidRequestError, match="the response would carry 630000 log-probabilities"):
        validate(generated, SERVER)
    validate(generated, RequestLimits(vocab_size=32000, max_context=1 << 20))  # in process: no response to bound
