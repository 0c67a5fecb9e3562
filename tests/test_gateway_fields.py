"""Which fields of OpenAI's bodies the gateway takes, in process (the real app over a recording
upstream): every field it does not implement is a 400 naming it, the ones that change nothing here
are accepted, a value beyond its protobuf field or a string that is not valid Unicode is a 400 in
OpenAI's shape (never a plain-text 500), and a request is bounded before it is built: prompts x n by
the server's max_batch_prompts, a prompt by the model's context. The OpenAI Batch path reads its
bodies through the same models (commands/openai_batch.py)."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import httpx
import pytest

from gateway.app import Settings, create_app
from gateway.schema import CompletionRequest, UnsupportedField
from moe_lightning.api.generation.v1 import generation_pb2
from moe_lightning.commands.openai_batch import _parse

MODEL = "tiny"
MAX_BATCH_PROMPTS = 1024  # orchestrator/api.py's, the gateway's default (test_the_gateways_default_limit_...)
CONTEXT = 64  # Settings.max_model_len
USER = [{"role": "user", "content": "hi"}]


class RecordingUpstream:
    """The gateway's upstream, answering every input with one token; remembers each call's inputs."""

    def __init__(self, max_batch_prompts: int = MAX_BATCH_PROMPTS, tool_call_format: str = "") -> None:
        self.max_batch_prompts = max_batch_prompts
        self.tool_call_format, self.reasoning_format = tool_call_format, ""
        self.calls: list[list[generation_pb2.GenerationInput]] = []

    async def generate_all(
        self, inputs: list[generation_pb2.GenerationInput], choices: int = 1
    ) -> list[generation_pb2.GenerationOutput]:
        self.calls.append(list(inputs))
        usage = generation_pb2.Usage(prompt_tokens=1, completion_tokens=1)
        return [
            generation_pb2.GenerationOutput(text="x", finish_reason=generation_pb2.FINISH_REASON_LENGTH, usage=usage)
            for _ in inputs
        ]

    async def serving(self, timeout: float = 1.0) -> bool:
        return True


def post(path: str, body: dict[str, Any] | bytes, upstream: RecordingUpstream | None = None) -> httpx.Response:
    """One request to the real app; an exception in it is its 500 response, as a server gives it."""
    app = create_app(Settings(MODEL, CONTEXT), upstream or RecordingUpstream())  # type: ignore[arg-type]
    content = body if isinstance(body, bytes) else json.dumps(body).encode()

    async def send() -> httpx.Response:
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as c:
            return await c.post(path, content=content, headers={"content-type": "application/json"})

    return asyncio.run(send())


def completion(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": "hello", "max_tokens": 1, **fields}


def chat(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": USER, "max_tokens": 1, **fields}


def refused(r: httpx.Response, param: str) -> str:
    """The 400's message, after checking its OpenAI shape and that it names `param`."""
    assert r.status_code == 400, (r.status_code, r.text)
    assert r.headers["content-type"] == "application/json"
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    assert error["param"] == param and param.split(".")[0] in error["message"], error
    return str(error["message"])


UNIMPLEMENTED = {
    "tools": [{"type": "function", "function": {"name": "f"}}],
    "tool_choice": "auto",
    "functions": [{"name": "f"}],
    "function_call": "auto",
    "moderation": {"model": "omni-moderation-latest"},
    "audio": {"voice": "alloy", "format": "wav"},
    "modalities": ["text", "audio"],
    "prediction": {"type": "content", "content": "x"},
    "web_search_options": {},
    "reasoning_effort": "low",
    "verbosity": "low",
}


# the chat API's own (tests/test_tool_calls_e2e.py; reasoning_effort: tests/test_harmony.py)
CHAT_TAKES = ("tools", "tool_choice", "reasoning_effort")
REFUSED_BY_ROUTE = [("/v1/completions", name, value) for name, value in UNIMPLEMENTED.items()] + [
    ("/v1/chat/completions", name, value) for name, value in UNIMPLEMENTED.items() if name not in CHAT_TAKES
]


@pytest.mark.parametrize(("route", "name", "value"), REFUSED_BY_ROUTE)
def test_every_unimplemented_field_is_refused_by_name(route: str, name: str, value: Any) -> None:
    body = (completion if route == "/v1/completions" else chat)(**{name: value})
    assert "is not supported" in refused(post(route, body), name)


@pytest.mark.parametrize(
    ("route", "name"),
    [
        ("/v1/completions", "min_p"),  # vLLM's sampling extras we do not implement
        ("/v1/completions", "guided_grammar"),  # vLLM's EBNF grammars: not taken (docs/structured-outputs.md)
        ("/v1/completions", "messages"),  # the other API's prompt
        ("/v1/completions", "max_completion_tokens"),
        ("/v1/chat/completions", "prompt"),
        ("/v1/chat/completions", "guided_decoding_backend"),
        ("/v1/chat/completions", "made_up"),
    ],
)
def test_an_unknown_field_is_refused_by_name(route: str, name: str) -> None:
    body = (completion if route == "/v1/completions" else chat)(**{name: 1})
    assert "is not a field this server takes" in refused(post(route, body), name)


def test_every_field_it_does_not_take_is_named_at_once() -> None:
    r = post("/v1/chat/completions", chat(min_p=0.1, functions=[{"name": "f"}], made_up=1))
    message = refused(r, "min_p")
    assert "made_up is not a field" in message and "functions is not supported" in message


NO_OPS = {
    "user": "u-1",
    "metadata": {"k": "v"},
    "store": False,
    "service_tier": "auto",
    "prompt_cache_key": "k",
    "prompt_cache_retention": "24h",
    "prompt_cache_options": {"ttl": "1h"},
}
NEUTRAL = {  # values of unimplemented fields that ask for nothing, as null does
    "tools": [],
    "tool_choice": "none",
    "functions": [],
    "function_call": "none",
    "response_format": {"type": "text"},
    "logit_bias": {},
    "modalities": ["text"],
    "parallel_tool_calls": False,  # without tools, either value asks nothing
    "audio": None,
}


def test_fields_that_change_nothing_are_accepted_and_no_others() -> None:
    upstream = RecordingUpstream()
    for route, body in (("/v1/completions", completion), ("/v1/chat/completions", chat)):
        r = post(route, body(**NO_OPS, **NEUTRAL), upstream)
        assert r.status_code == 200, r.text
        refused(post(route, body(**NO_OPS, **NEUTRAL, unknown=1)), "unknown")
        for name in ("presence_penalty", "frequency_penalty"):  # taken within OpenAI's range, named beyond it
            assert post(route, body(**{name: 0.5}), upstream).status_code == 200
            assert "-2..2" in refused(post(route, body(**{name: 2.5})), name)
        assert post(route, body(logit_bias={"5": 10}), upstream).status_code == 200
        assert "-100..100" in refused(post(route, body(logit_bias={"5": 101})), "logit_bias")
    # what lm-eval's local-completions and local-chat-completions send (lm_eval/models/openai_completions.py)
    lm_eval = {"max_tokens": 4, "temperature": 0, "stop": ["\n\n"], "seed": 1234}
    assert post("/v1/completions", {"model": MODEL, "prompt": [[1, 2, 3], [4, 5]], **lm_eval}, upstream).is_success
    assert post("/v1/chat/completions", {"model": MODEL, "messages": USER, **lm_eval}, upstream).is_success
    assert len(upstream.calls) == 10


def test_chat_messages_take_name_and_tool_turns_but_refuse_them_misplaced() -> None:
    # a client that appends a response's message to the conversation sends its null fields back
    assistant = {"role": "assistant", "content": "ok", "name": "bot", "tool_calls": [], "refusal": None}
    r = post("/v1/chat/completions", chat(messages=[{"role": "user", "content": "a", "name": "ann"}, assistant]))
    assert r.status_code == 200, r.text
    message = refused(
        post("/v1/chat/completions", chat(messages=[{"role": "function", "content": "42", "name": "f"}])),
        "messages.0.role",
    )
    assert "role 'function' is not supported" in message
    calls = [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]
    round_trip = [
        *USER,
        {"role": "assistant", "content": None, "tool_calls": calls},
        {"role": "tool", "content": "42", "tool_call_id": "c"},
    ]
    upstream = RecordingUpstream()
    assert post("/v1/chat/completions", chat(messages=round_trip), upstream).status_code == 200
    sent = upstream.calls[0][0].messages.messages
    assert [m.role for m in sent] == ["user", "assistant", "tool"]
    assert sent[1].tool_calls[0].name == "f" and sent[2].tool_call_id == "c"
    misplaced = chat(messages=[{"role": "user", "content": "x", "tool_calls": calls}])
    assert "only an assistant" in refused(post("/v1/chat/completions", misplaced), "messages.0.tool_calls")
    tool_call_id = chat(messages=[{"role": "user", "content": "x", "tool_call_id": "c"}])
    refused(post("/v1/chat/completions", tool_call_id), "messages.0.tool_call_id")
    no_id = chat(messages=[*USER, {"role": "tool", "content": "42"}])
    refused(post("/v1/chat/completions", no_id), "messages.1.tool_call_id")
    bad_call = chat(messages=[*USER, {"role": "assistant", "content": "", "tool_calls": [{"type": "web"}]}])
    assert "only function tool calls" in refused(post("/v1/chat/completions", bad_call), "messages.1.tool_calls.0")
    refused(post("/v1/chat/completions", chat(messages=[{"role": "user", "content": "x", "x": 1}])), "messages.0.x")


@pytest.mark.parametrize(
    ("route", "fields", "param"),
    [
        ("/v1/completions", {"max_tokens": 2**31}, "max_tokens"),  # int32
        ("/v1/chat/completions", {"max_completion_tokens": 2**31}, "max_completion_tokens"),
        ("/v1/chat/completions", {"max_tokens": 2**63}, "max_tokens"),
        ("/v1/completions", {"seed": 2**64}, "seed"),  # uint64
        ("/v1/completions", {"top_k": 2**40}, "top_k"),  # int32
        ("/v1/completions", {"prompt": [1, 2**64]}, "prompt"),  # a token id: int32
        ("/v1/completions", {"prompt": [[1], [2, 2**31]]}, "prompt"),
        ("/v1/completions", {"prompt": [-1]}, "prompt"),
        ("/v1/completions", {"prompt": [1, True]}, "prompt"),
        ("/v1/completions", {"temperature": 1e39}, "temperature"),  # float: it would be inf
    ],
)
def test_an_integer_beyond_its_protobuf_field_is_a_400(route: str, fields: dict[str, Any], param: str) -> None:
    body = (completion if route == "/v1/completions" else chat)(**fields)
    refused(post(route, body), param)


def test_the_largest_seed_of_each_choice_wraps_within_its_field() -> None:
    upstream = RecordingUpstream()
    assert post("/v1/completions", completion(seed=2**64 - 1, n=2), upstream).status_code == 200
    assert [m.seed for m in upstream.calls[0]] == [2**64 - 1, 0]


@pytest.mark.parametrize(
    ("route", "raw", "param"),
    [
        ("/v1/completions", b'{"model": "tiny", "prompt": "a \\ud800 b"}', "prompt"),
        ("/v1/completions", b'{"model": "tiny", "prompt": ["ok", "\\udc00"]}', "prompt.1"),
        ("/v1/completions", b'{"model": "tiny", "prompt": "a", "stop": ["\\ud83d"]}', "stop.0"),
        ("/v1/completions", b'{"model": "tiny", "prompt": "a", "stop": "\\ud83d"}', "stop"),
        ("/v1/completions", b'{"model": "tiny\\udfff", "prompt": "a"}', "model"),
        ("/v1/completions", b'{"model": "tiny", "prompt": "a", "user": "\\ud800"}', "user"),
        ("/v1/chat/completions", b'{"model": "tiny", "messages": [{"role": "user", "content": "\\ud800"}]}', ""),
        (
            "/v1/chat/completions",
            b'{"model": "tiny", "messages": [{"role": "user", "content": [{"type": "text", "text": "\\udbff"}]}]}',
            "messages.0.content.0.text",
        ),
        ("/v1/completions", b'{"model": "tiny", "prompt": "a", "\\ud800": 1}', "\\ud800"),
    ],
)
def test_a_lone_surrogate_is_a_400_naming_its_field(route: str, raw: bytes, param: str) -> None:
    param = param or "messages.0.content"
    assert "not valid Unicode" in refused(post(route, raw), param)


def test_a_pair_of_surrogate_escapes_is_one_character_and_fine_and_half_of_it_is_not() -> None:
    upstream = RecordingUpstream()
    r = post("/v1/completions", b'{"model": "tiny", "prompt": "smile \\ud83d\\ude00", "max_tokens": 1}', upstream)
    assert r.status_code == 200 and upstream.calls[0][0].text == "smile \U0001f600"
    refused(post("/v1/completions", b'{"model": "tiny", "prompt": "smile \\ud83d", "max_tokens": 1}'), "prompt")


def test_prompts_times_choices_are_bounded_by_the_servers_max_batch_prompts() -> None:
    upstream = RecordingUpstream(max_batch_prompts=8)  # what the server said (GetServerMetadata)
    message = refused(post("/v1/completions", completion(prompt=["a"] * 9), upstream), "prompt")
    assert "9 generations" in message and "at most 8" in message and "max_batch_prompts" in message
    refused(post("/v1/completions", completion(prompt=["a"] * 3, n=3), upstream), "prompt")
    refused(post("/v1/completions", completion(prompt=["a"] * 5, n=2, stream=True), upstream), "prompt")
    refused(post("/v1/chat/completions", chat(n=9), upstream), "n")
    assert upstream.calls == []  # nothing was sent
    assert post("/v1/completions", completion(prompt=["a"] * 4, n=2), upstream).status_code == 200
    assert [len(c) for c in upstream.calls] == [8]  # one call with every choice


def test_a_prompt_longer_than_the_context_is_refused_before_it_is_built() -> None:
    upstream = RecordingUpstream()
    message = refused(post("/v1/completions", completion(prompt=list(range(CONTEXT + 1))), upstream), "prompt")
    assert f"{CONTEXT + 1} token ids" in message
    refused(post("/v1/completions", completion(prompt=[[1], list(range(CONTEXT + 1))]), upstream), "prompt")
    refused(post("/v1/completions", completion(prompt="x" * (8 * CONTEXT + 1)), upstream), "prompt")
    many = chat(messages=[{"role": "user", "content": "a"}] * (CONTEXT + 1))
    assert f"{CONTEXT + 1} messages" in refused(post("/v1/chat/completions", many, upstream), "messages")
    long = chat(messages=[{"role": "user", "content": "x" * (8 * CONTEXT + 1)}])
    refused(post("/v1/chat/completions", long, upstream), "messages")
    assert upstream.calls == []
    assert post("/v1/completions", completion(prompt=list(range(CONTEXT))), upstream).status_code == 200


def test_the_batch_path_refuses_what_the_gateway_refuses() -> None:
    def line(body: dict[str, Any] | str, url: str = "/v1/completions") -> str:
        body_json = body if isinstance(body, str) else json.dumps(body)
        return f'{{"custom_id": "c", "method": "POST", "url": "{url}", "body": {body_json}}}'

    tools = _parse(line(completion(tools=[{"type": "function"}])), 1)
    assert tools.error is not None and tools.error.param == "tools" and tools.error.status == 400
    lone = _parse(line('{"model": "tiny", "prompt": "\\ud800"}'), 2)
    assert lone.error is not None and lone.error.param == "prompt" and "not valid Unicode" in lone.error.message
    big = _parse(line(completion(max_tokens=2**31)), 3)
    assert big.error is not None and big.error.param == "max_tokens"
    fanout = _parse(line(completion(prompt=["a"] * (MAX_BATCH_PROMPTS + 1))), 4)
    assert (
        fanout.error is not None and fanout.error.param == "prompt" and str(MAX_BATCH_PROMPTS) in fanout.error.message
    )
    role = _parse(line(chat(messages=[{"role": "function", "content": "x"}]), "/v1/chat/completions"), 5)
    assert role.error is not None and role.error.param == "messages.0.role"
    ok = _parse(line(completion(user="u", prompt=["a", "b"])), 6)
    assert ok.error is None and len(ok.inputs) == 2


def test_the_gateways_default_limit_is_the_orchestrators() -> None:
    from gateway.schema import MAX_BATCH_PROMPTS as GATEWAY
    from gateway.upstream import Upstream
    from orchestrator.api import MAX_BATCH_PROMPTS as ORCHESTRATOR

    assert GATEWAY == ORCHESTRATOR == MAX_BATCH_PROMPTS

    async def default() -> int:
        upstream = Upstream("127.0.0.1:1")
        try:
            return upstream.max_batch_prompts  # until the server says its own (model_info)
        finally:
            await upstream.close()

    assert asyncio.run(default()) == MAX_BATCH_PROMPTS


def test_batch_file_chunks_stay_within_the_servers_max_batch_prompts() -> None:
    """A chunk of lines whose prompts x n pass max_batch_prompts would be refused whole by BatchGenerate
    and then retried line by line: chunks are cut by inputs as well as by lines."""
    from moe_lightning.commands.openai_batch import chunk_lines

    lines = [_parse(json.dumps({"custom_id": f"c{i}", "url": "/v1/completions", "body": completion(
        prompt=["a"] * 100, n=4)}), i) for i in range(10)]  # fmt: skip
    assert all(len(line.inputs) == 400 for line in lines)
    chunks = chunk_lines(lines, chunk_size=64, max_inputs=MAX_BATCH_PROMPTS)
    assert [len(c) for c in chunks] == [2, 2, 2, 2, 2]
    assert all(sum(len(line.inputs) for line in c) <= MAX_BATCH_PROMPTS for c in chunks)
    assert [len(c) for c in chunk_lines(lines, chunk_size=3, max_inputs=10_000)] == [3, 3, 3, 1]


def test_a_refused_batch_row_is_named_by_its_prompt_not_the_batch_index() -> None:
    """A request's prompts x n choices go as one BatchGenerate, which names a refused row `input i`: the
    HTTP client sees its own prompt's index (or none for one prompt), never the flattened index."""
    from gateway.upstream import batch_row_name

    assert (
        batch_row_name("input 5: prompt token ids [999] are outside", 6, 2)
        == "prompt 2: prompt token ids [999] are outside"
    )
    assert batch_row_name("input 1: the chat template refused it", 2, 2) == "the chat template refused it"
    assert batch_row_name("the queue is full", 4, 1) == "the queue is full"


def test_millions_of_token_ids_cost_about_their_json_parse() -> None:
    """A prompt of token ids is validated at C speed before its length is refused: 2.7 M ids (an 8 MiB
    body) took 12 s of the gateway's event loop through pydantic's union and Python walks, ~40x their
    json.loads; measured against that parse in the same run (machines here are noisy)."""
    raw = json.dumps({"model": "tiny", "prompt": [1] * 2_700_000})
    t0 = time.perf_counter()
    data = json.loads(raw)
    parse = time.perf_counter() - t0
    t0 = time.perf_counter()
    body = CompletionRequest.model_validate(data)
    validate = time.perf_counter() - t0
    with pytest.raises(UnsupportedField, match="2700000 token ids"):
        body.inputs(CONTEXT)
    print(f"2.7 M token ids: json.loads {parse:.2f} s, validation {validate:.2f} s ({validate / parse:.1f}x)")
    assert validate < 5 * parse
