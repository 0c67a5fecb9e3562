"""GPT-OSS's demo checkpoint through the whole stack and the OpenAI gateway: its harmony template (the
prompt transformers renders from the same tokenizer_config.json), `reasoning_effort`, the answer read
into reasoning_content and content by the gpt_oss parser from the text with its special tokens kept,
and a tool call in the commentary channel (docs/openai.md, "Harmony (GPT-OSS)")."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest
from test_structured_outputs_e2e import TOOL_BUDGET, WEATHER

from moe_lightning.client import GenerationClient, Prompt
from moe_lightning.launcher import Stack
from moe_lightning.reasoning import ReasoningParser

USER = [{"role": "user", "content": "What is 2 + 2?"}]


@pytest.fixture(scope="module")
def gpt_oss_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from moe_lightning.demo_model import write_demo_model

    return write_demo_model(tmp_path_factory.mktemp("gpt_oss"), "tiny", seed=4, progress=False, arch="gpt-oss")


@pytest.fixture(scope="module")
def stack(make_module_stack: Callable[..., Stack], gpt_oss_model: Path) -> Stack:
    return make_module_stack(model=gpt_oss_model, http_port=0, kv_cache_memory="64MiB")


def client(stack: Stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.http_address}/v1", api_key="unused", max_retries=0)


def test_the_server_reads_harmony_from_the_template(stack: Stack) -> None:
    with GenerationClient(stack.api_address, timeout=30) as c:
        meta = c.server_metadata()
    assert (meta.tool_call_format, meta.reasoning_format) == ("harmony", "gpt_oss")


@pytest.mark.parametrize("effort", ["low", "high"])
def test_reasoning_effort_reaches_the_template_and_the_answer_is_split(
    stack: Stack, gpt_oss_model: Path, effort: str
) -> None:
    """The prompt is transformers' rendering with that effort; the message is what the gpt_oss parser makes
    of the same greedy tokens decoded with their special tokens."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(gpt_oss_model)
    prompt = tok.apply_chat_template(USER, add_generation_prompt=True, reasoning_effort=effort, tokenize=True)
    prompt = list(prompt["input_ids"] if isinstance(prompt, dict) or hasattr(prompt, "keys") else prompt)
    answer = client(stack).chat.completions.create(
        model=stack.config.model.name, messages=USER, max_tokens=24, temperature=0, reasoning_effort=effort
    )
    assert answer.usage is not None and answer.usage.prompt_tokens == len(prompt)
    with GenerationClient(stack.api_address, timeout=60) as c:
        [raw] = c.batch_generate([Prompt(token_ids=prompt, max_new_tokens=24)])
    text = tok.decode(raw.token_ids, skip_special_tokens=False)
    reasoning, content = ReasoningParser("gpt_oss").split(text)
    message = answer.choices[0].message
    assert message.content == content
    assert (message.model_extra or {}).get("reasoning_content") == reasoning


def test_completions_refuse_reasoning_effort(stack: Stack) -> None:
    with pytest.raises(openai.BadRequestError, match="reasoning_effort"):
        client(stack).completions.create(
            model=stack.config.model.name, prompt="x", max_tokens=2, extra_body={"reasoning_effort": "low"}
        )


@pytest.mark.parametrize("stream", [False, True])
def test_a_named_tool_call_comes_back_as_a_tool_call(stack: Stack, stream: bool) -> None:
    kw: dict[str, Any] = {
        "model": stack.config.model.name,
        "messages": [{"role": "user", "content": "What is the weather in Paris?"}],
        "tools": [WEATHER],
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        "max_tokens": TOOL_BUDGET,
        "temperature": 1.0,
        "seed": 3,
    }
    c = client(stack)
    if stream:
        name, arguments, finish = "", "", None
        for ch in c.chat.completions.create(stream=True, **kw):
            if not ch.choices:
                continue
            for tc in ch.choices[0].delta.tool_calls or []:
                name += (tc.function.name or "") if tc.function else ""
                arguments += (tc.function.arguments or "") if tc.function else ""
            finish = ch.choices[0].finish_reason or finish
    else:
        r = c.chat.completions.create(**kw)
        [call] = r.choices[0].message.tool_calls or []
        name, arguments, finish = call.function.name, call.function.arguments, r.choices[0].finish_reason  # type: ignore[union-attr]
    assert finish == "tool_calls" and name == "get_weather"
    jsonschema.validate(json.loads(arguments), WEATHER["function"]["parameters"])  # type: ignore[index]
