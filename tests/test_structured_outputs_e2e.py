"""Structured output and tools through a real stack with random weights, with the clients users run:
every output of a grammar parses (a JSON schema's validates against it) however the random model
samples, also when preempted and re-prefilled; the `openai` client's `chat.completions.parse` returns
its pydantic object; a tool-call round trip (call, tool result, answer), streamed and not, in the
Qwen3 template's hermes format; a schema the library cannot compile is a 400 naming the problem
(docs/structured-outputs.md, docs/openai.md "Tools")."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import httpx
import jsonschema
import openai
import pydantic
import pytest

from moe_lightning.client import GenerationClient, Prompt
from moe_lightning.launcher import Stack

TEMPLATES = Path(__file__).parent / "data" / "chat_templates"
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "mood": {"enum": ["happy", "sad", "calm"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 2},
    },
    "required": ["name", "age", "mood"],
    "additionalProperties": False,
}
# whitespace between JSON tokens is at most 32 characters a gap (grammar/compiler.py), every string and
# array bounded: a random model's output fits in this many tokens, so it always ends by the grammar
BUDGET = 768
TOOL_BUDGET = 380  # what the demo model's 1,024-token context leaves after Qwen3's prompt with a tool
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"enum": ["Paris", "Oslo"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 3},
            },
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
}


@pytest.fixture(scope="module")
def stack(make_module_stack: Callable[..., Stack], tiny_model: Path) -> Stack:
    # Qwen3's published template on the demo model: the hermes tool-call format and qwen3 reasoning
    return make_module_stack(
        model=tiny_model,
        http_port=0,
        max_batch_size=64,
        kv_cache_memory="64MiB",
        chat_template=TEMPLATES / "qwen3-30b-a3b.jinja",
    )


def people(n: int) -> list[Prompt]:
    """n sampled prompts under SCHEMA, each with a seed of its own."""
    grammar = ("json_schema", json.dumps(SCHEMA))
    return [
        Prompt(text=f"Person {i}:", max_new_tokens=BUDGET, temperature=1.0, seed=i, grammar=grammar) for i in range(n)
    ]


def client(stack: Stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.http_address}/v1", api_key="unused", max_retries=0)


def test_every_sampled_output_matches_its_schema_over_grpc(stack: Stack) -> None:
    with GenerationClient(stack.api_address, timeout=300) as c:
        done = c.batch_generate(
            people(48)
            + [
                Prompt(
                    text="Pick:",
                    max_new_tokens=8,
                    temperature=1.0,
                    seed=i,
                    grammar=("choice", '["yes", "no", "maybe so"]'),
                )
                for i in range(8)
            ]
            + [
                Prompt(
                    text="Mail:",
                    max_new_tokens=64,
                    temperature=1.0,
                    seed=i,
                    grammar=("regex", "[a-z]{1,8}@[a-z]{1,8}\\.(com|org)"),
                )
                for i in range(8)
            ]
        )
    for d in done[:48]:
        assert d.finish_reason == "eos", d.text  # the grammar ended it, never the budget
        jsonschema.validate(json.loads(d.text), SCHEMA)
    assert all(d.text in ("yes", "no", "maybe so") for d in done[48:56])
    import re

    assert all(re.fullmatch(r"[a-z]{1,8}@[a-z]{1,8}\.(com|org)", d.text) for d in done[56:])


def _metric(stack: Stack, service: str, sample: str) -> float:
    text = httpx.get(stack.endpoints()[service]["metrics"], timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(sample))


def test_the_masks_follow_their_step_and_arrive_in_time(stack: Stack) -> None:
    """Issue 54: the orchestrator sends each step first and its guided rows' masks after (filled while its
    layers run); gpu_expert's head receives them all, none timed out. They used to travel in the step,
    filled before it was sent."""
    before = _metric(stack, "gpu_expert", "moe_lightning_grammar_mask_deliveries_total")
    with GenerationClient(stack.api_address, timeout=300) as c:
        done = c.generate(Prompt(text="Pick:", max_new_tokens=8, seed=1, grammar=("choice", '["yes", "no"]')))
    assert done.text in ("yes", "no")
    assert _metric(stack, "gpu_expert", "moe_lightning_grammar_mask_deliveries_total") > before
    assert _metric(stack, "gpu_expert", 'moe_lightning_grammar_mask_deliveries_total{arrival="late"}') == 0
    assert _metric(stack, "gpu_expert", "moe_lightning_grammar_mask_timeouts_total") == 0


def test_grammars_survive_preemption(tiny_model: Path, make_stack: Callable[..., Stack]) -> None:
    from test_preemption_e2e import kv_bytes

    stack = make_stack(
        model=tiny_model,
        kv_cache_memory=kv_bytes(tiny_model, BUDGET + 32),
        max_batch_size=32,
        extra={"cpu_attention": ["--block-size", "4"]},
    )
    with GenerationClient(stack.api_address, timeout=300) as c:
        done = c.batch_generate(people(24))
    assert sum(d.preemptions for d in done) > 0
    for d in done:
        jsonschema.validate(json.loads(d.text), SCHEMA)


class Person(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=8)
    age: int = pydantic.Field(ge=0, le=120)
    mood: Literal["happy", "sad", "calm"]


def test_openai_parse_returns_the_pydantic_object(stack: Stack) -> None:
    c = client(stack)
    for seed in range(4):
        r = c.chat.completions.parse(
            model=stack.config.model.name,
            messages=[{"role": "user", "content": "Describe a person."}],
            response_format=Person,
            max_tokens=BUDGET,
            temperature=1.0,
            seed=seed,
        )
        person = r.choices[0].message.parsed
        assert isinstance(person, Person) and r.choices[0].finish_reason == "stop"
    obj = c.chat.completions.create(
        model=stack.config.model.name,
        messages=[{"role": "user", "content": "JSON please"}],
        response_format={"type": "json_object"},
        max_tokens=BUDGET,
        temperature=1.0,
        seed=1,
    )
    assert isinstance(json.loads(obj.choices[0].message.content or ""), dict)
    stream = c.chat.completions.create(
        model=stack.config.model.name,
        messages=[{"role": "user", "content": "Describe a person."}],
        response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA, "strict": True}},
        max_tokens=BUDGET,
        temperature=1.0,
        seed=2,
        stream=True,
    )
    text = "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices)
    jsonschema.validate(json.loads(text), SCHEMA)


def test_a_schema_the_library_cannot_compile_is_a_400_naming_the_problem(stack: Stack) -> None:
    for bad, says in (
        ({"type": "integer", "minimum": 5, "maximum": 1}, "minimum (5) is greater than maximum (1)"),
        ({"type": "strin"}, "Invalid type: strin"),
        ({"$ref": "#/defs/nope"}, "'/defs/nope' does not exist"),
    ):
        r = httpx.post(
            f"{stack.http_address}/v1/chat/completions",
            json={"model": stack.config.model.name, "messages": [{"role": "user", "content": "x"}], "guided_json": bad},
            timeout=60,
        )
        assert r.status_code == 400 and says in r.json()["error"]["message"], r.text
    r = httpx.post(
        f"{stack.http_address}/v1/completions",
        json={"model": stack.config.model.name, "prompt": "x", "guided_regex": "(unclosed"},
        timeout=60,
    )
    assert r.status_code == 400 and "regex" in r.json()["error"]["message"].lower(), r.text


def tool_round_trip(c: openai.OpenAI, model: str, stream: bool, **choice: Any) -> None:
    messages: list[Any] = [{"role": "user", "content": "What is the weather in Paris?"}]
    kw = {"model": model, "tools": [WEATHER], "max_tokens": TOOL_BUDGET, "temperature": 1.0, "seed": 3, **choice}
    if stream:
        calls: dict[int, dict[str, str]] = {}
        finish = None
        for ch in c.chat.completions.create(messages=messages, stream=True, **kw):
            if not ch.choices:
                continue
            for tc in ch.choices[0].delta.tool_calls or []:
                entry = calls.setdefault(tc.index, {"id": "", "name": "", "arguments": ""})
                entry["id"] += tc.id or ""
                entry["name"] += (tc.function.name or "") if tc.function else ""
                entry["arguments"] += (tc.function.arguments or "") if tc.function else ""
            finish = ch.choices[0].finish_reason or finish
        assert finish == "tool_calls" and calls
        call = calls[0]
        call_id, name, arguments = call["id"], call["name"], call["arguments"]
    else:
        r = c.chat.completions.create(messages=messages, **kw)
        assert r.choices[0].finish_reason == "tool_calls"
        tool_calls = r.choices[0].message.tool_calls
        assert tool_calls
        call_id, name, arguments = tool_calls[0].id, tool_calls[0].function.name, tool_calls[0].function.arguments  # type: ignore[union-attr]
    assert name == "get_weather" and call_id.startswith("call_")
    jsonschema.validate(json.loads(arguments), WEATHER["function"]["parameters"])  # type: ignore[index]
    messages.append(
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}],
        }
    )
    messages.append({"role": "tool", "tool_call_id": call_id, "content": '{"celsius": 21}'})
    answer = c.chat.completions.create(
        model=model, messages=messages, tools=[WEATHER], tool_choice="none", max_tokens=8, temperature=0
    )
    assert answer.choices[0].message.tool_calls is None and answer.choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("choice", ["required", "named"])
def test_a_tool_call_round_trip_with_the_openai_client(stack: Stack, stream: bool, choice: str) -> None:
    tool_choice: Any = choice if choice == "required" else {"type": "function", "function": {"name": "get_weather"}}
    # one call: with parallel calls allowed, a random model goes on calling until its budget ends
    tool_round_trip(client(stack), stack.config.model.name, stream, tool_choice=tool_choice, parallel_tool_calls=False)


def test_the_server_says_its_formats(stack: Stack) -> None:
    with GenerationClient(stack.api_address, timeout=30) as c:
        meta = c.server_metadata()
    assert (meta.tool_call_format, meta.reasoning_format) == ("hermes", "qwen3")


def test_template_kwargs_and_reasoning_through_the_stack(stack: Stack) -> None:
    """Qwen3's enable_thinking reaches its template (the prompt differs), and the answer's reasoning comes
    back apart: with thinking on, a random model never closes </think>, so all of it is reasoning; with
    it off, all of it is content."""
    c = client(stack)
    kw: dict[str, Any] = {"model": stack.config.model.name, "max_tokens": 6, "temperature": 0}
    user = [{"role": "user", "content": "Hi"}]
    on = c.chat.completions.create(messages=user, **kw)
    off = c.chat.completions.create(
        messages=user, extra_body={"chat_template_kwargs": {"enable_thinking": False}}, **kw
    )
    assert on.usage is not None and off.usage is not None and off.usage.prompt_tokens > on.usage.prompt_tokens
    reasoning = on.choices[0].message.model_extra.get("reasoning_content")  # type: ignore[union-attr]
    assert reasoning and on.choices[0].message.content is None
    assert off.choices[0].message.content and not (off.choices[0].message.model_extra or {}).get("reasoning_content")
    streamed = c.chat.completions.create(messages=user, stream=True, **kw)
    pieces = [ch.choices[0].delta.model_extra.get("reasoning_content") or "" for ch in streamed if ch.choices]  # type: ignore[union-attr]
    assert "".join(pieces) == reasoning
    bad = httpx.post(
        f"{stack.http_address}/v1/chat/completions",
        json={**kw, "messages": user, "chat_template_kwargs": {"messages": []}},
        timeout=60,
    )
    assert bad.status_code == 400 and "reserved" in bad.json()["error"]["message"], bad.text
