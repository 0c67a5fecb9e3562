"""The sampling controls, echo and structured output's fields of the OpenAI bodies, in process (the real
app over a recording upstream): what each becomes in the GenerationInput, and every bad value a 400
naming its field, with the rule SamplingParams holds (moe_lightning/sampling.py)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from test_gateway_fields import RecordingUpstream, chat, completion, post, refused

from moe_lightning.api.generation.v1 import generation_pb2


def sent(route: str, body: dict[str, Any]) -> generation_pb2.GenerationInput:
    upstream = RecordingUpstream()
    r = post(route, body, upstream)
    assert r.status_code == 200, r.text
    return upstream.calls[0][0]


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_sampling_controls_reach_the_input(route: str) -> None:
    make = completion if route == "/v1/completions" else chat
    m = sent(
        route,
        make(
            presence_penalty=0.5,
            frequency_penalty=-1.25,
            repetition_penalty=1.3,
            logit_bias={"7": 5, "11": -100},
            min_tokens=1,
            stop_token_ids=[3, 4],
            prompt_logprobs=2,
        ),
    )
    assert (m.presence_penalty, m.frequency_penalty) == (0.5, -1.25)
    assert m.repetition_penalty == pytest.approx(1.3)
    assert dict(m.logit_bias) == {7: 5.0, 11: -100.0}
    assert (m.min_tokens, list(m.stop_token_ids), m.prompt_logprobs) == (1, [3, 4], 2)
    plain = sent(route, make())
    assert not plain.HasField("repetition_penalty") and not plain.HasField("prompt_logprobs")
    assert not plain.logit_bias and not plain.HasField("grammar")


@pytest.mark.parametrize(
    ("fields", "param", "says"),
    [
        ({"presence_penalty": -2.01}, "presence_penalty", "-2..2"),
        ({"frequency_penalty": 3}, "frequency_penalty", "-2..2"),
        ({"repetition_penalty": 0}, "repetition_penalty", "0.01..2"),
        ({"repetition_penalty": 1e-45}, "repetition_penalty", "0.01..2"),
        ({"repetition_penalty": 2.5}, "repetition_penalty", "0.01..2"),
        ({"logit_bias": {"a": 1}}, "logit_bias", "token ids"),
        ({"logit_bias": {"-1": 1}}, "logit_bias", "token ids"),
        ({"logit_bias": {"5": -100.5}}, "logit_bias", "-100..100"),
        ({"logit_bias": {str(i): 1 for i in range(1025)}}, "logit_bias", "at most 1024"),
        ({"stop_token_ids": list(range(65))}, "stop_token_ids", "at most 64"),
        ({"prompt_logprobs": 21}, "prompt_logprobs", "less than or equal to 20"),
        ({"min_tokens": -1}, "min_tokens", "greater than or equal to 0"),
        ({"response_format": {"type": "yaml"}}, "response_format.type", "text, json_object or json_schema"),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema", "with the schema"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": "{nope"}}},
            "response_format.json_schema.schema",
            "not valid JSON",
        ),
        ({"guided_regex": ""}, "guided_regex", "non-empty"),
        ({"guided_choice": []}, "guided_choice", "non-empty list"),
        ({"guided_choice": ["a", 1]}, "guided_choice", "list of non-empty strings"),
        ({"guided_json": 5}, "guided_json", "must be a JSON schema (an object), got int"),
        ({"guided_regex": ["a"]}, "guided_regex", "non-empty regular expression"),
        ({"guided_regex": "a+", "guided_choice": ["a"]}, "guided_regex", "set one of them"),
        ({"response_format": {"type": "json_object"}, "guided_json": {}}, "response_format", "set one of them"),
    ],
)
@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_a_bad_control_is_a_400_naming_it(route: str, fields: dict[str, Any], param: str, says: str) -> None:
    make = completion if route == "/v1/completions" else chat
    assert says in refused(post(route, make(**fields)), param)


def test_structured_output_fields_become_one_grammar() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    cases = [
        ({"response_format": {"type": "json_object"}}, generation_pb2.GRAMMAR_KIND_JSON_OBJECT, ""),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}},
            generation_pb2.GRAMMAR_KIND_JSON_SCHEMA,
            schema,
        ),
        ({"guided_json": schema}, generation_pb2.GRAMMAR_KIND_JSON_SCHEMA, schema),
        ({"guided_json": json.dumps(schema)}, generation_pb2.GRAMMAR_KIND_JSON_SCHEMA, schema),
        ({"guided_regex": "[a-z]+@[a-z]+\\.com"}, generation_pb2.GRAMMAR_KIND_REGEX, "[a-z]+@[a-z]+\\.com"),
        ({"guided_choice": ["yes", "no"]}, generation_pb2.GRAMMAR_KIND_CHOICE, ["yes", "no"]),
    ]
    for fields, kind, source in cases:
        for route, make in (("/v1/completions", completion), ("/v1/chat/completions", chat)):
            m = sent(route, make(**fields))
            assert m.grammar.kind == kind
            got = m.grammar.source if isinstance(source, str) else json.loads(m.grammar.source)
            assert got == source
    assert not sent("/v1/chat/completions", chat(response_format={"type": "text"})).HasField("grammar")


def test_echo_and_scoring_on_completions() -> None:
    m = sent("/v1/completions", completion(echo=True, logprobs=2, max_tokens=0))
    assert m.echo and m.prompt_logprobs == 2 and m.logprobs == 2 and m.max_new_tokens == 1
    assert sent("/v1/completions", completion(echo=True)).echo
    assert "only allowed with echo" in refused(post("/v1/completions", completion(max_tokens=0)), "max_tokens")
    assert "with stream" in refused(post("/v1/completions", completion(echo=True, stream=True)), "echo")
    body = post("/v1/completions", completion(echo=True, max_tokens=0)).json()
    assert body["usage"]["completion_tokens"] == 0 and body["choices"][0]["finish_reason"] == "length"
