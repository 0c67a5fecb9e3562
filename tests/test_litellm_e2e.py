"""litellm, the client many data pipelines call every provider through, against the gateway as an
"openai/" provider: one call of each kind (a chat, a text completion, a stream, a structured output, a
tool call), each answered as the OpenAI API answers (docs/openai.md)."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from test_structured_outputs_e2e import SCHEMA, TEMPLATES, TOOL_BUDGET, WEATHER

from moe_lightning.launcher import Stack

# litellm fetches its model price list from the internet at import unless told to use its own copy
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
litellm = pytest.importorskip("litellm", reason="litellm is not installed (make dev installs it where it can)")


@pytest.fixture(scope="module")
def stack(make_module_stack: Callable[..., Stack], tiny_model: Path) -> Stack:
    return make_module_stack(
        model=tiny_model, http_port=0, kv_cache_memory="64MiB", chat_template=TEMPLATES / "qwen3-30b-a3b.jinja"
    )


def call_args(stack: Stack) -> dict[str, Any]:
    return {"model": f"openai/{stack.config.model.name}", "api_base": f"{stack.http_address}/v1", "api_key": "unused"}


def test_one_call_of_each_kind(stack: Stack) -> None:
    kw = call_args(stack)
    user = [{"role": "user", "content": "Hello"}]
    # Qwen3's template thinks by default, and the random model never closes its thinking, so its
    # whole answer would be reasoning_content with a null content (as vLLM answers): ask for none
    no_thinking = {"chat_template_kwargs": {"enable_thinking": False}}
    chat = litellm.completion(messages=user, max_tokens=8, temperature=0, extra_body=no_thinking, **kw)
    assert chat.choices[0].message.content is not None and chat.usage.completion_tokens > 0
    text = litellm.text_completion(prompt="Once upon a time", max_tokens=8, temperature=0, **kw)
    assert isinstance(text.choices[0].text, str) and text.choices[0].text
    pieces = litellm.completion(messages=user, max_tokens=8, temperature=0, stream=True, extra_body=no_thinking, **kw)
    streamed = "".join(p.choices[0].delta.content or "" for p in pieces if p.choices)
    assert streamed == chat.choices[0].message.content
    structured = litellm.completion(
        messages=user,
        response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA, "strict": True}},
        max_tokens=768,
        temperature=1.0,
        seed=5,
        **kw,
    )
    import jsonschema

    jsonschema.validate(json.loads(structured.choices[0].message.content), SCHEMA)
    tool = litellm.completion(
        messages=[{"role": "user", "content": "Weather in Oslo?"}],
        tools=[WEATHER],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=TOOL_BUDGET,
        temperature=1.0,
        seed=3,
        **kw,
    )
    calls = tool.choices[0].message.tool_calls
    assert tool.choices[0].finish_reason == "tool_calls" and calls and calls[0].function.name == "get_weather"
    jsonschema.validate(json.loads(calls[0].function.arguments), WEATHER["function"]["parameters"])  # type: ignore[index]
