"""A thinking model's reasoning split from its answer (moe_lightning.reasoning): as vLLM's qwen3 and
deepseek_r1 parsers split it, whole and streamed, the stream's pieces adding up to the whole however
the text is cut; and, for Qwen3, the reasoning then the tool calls of one answer."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moe_lightning.chat_template import ChatMessage, ChatTemplate, ToolSpec
from moe_lightning.reasoning import FAMILIES, ReasoningParser, detect_reasoning
from moe_lightning.tool_calls import StreamingToolParser, assemble, parser_for

DATA = Path(__file__).parent / "data" / "chat_templates"
MODELS = json.loads((DATA / "models.json").read_text())

# (answer, (reasoning, content)) with thinking on: what comes before </think> is reasoning
THINKING = [
    ("<think>\nThe user greets me.\n</think>\n\nHello!", ("\nThe user greets me.\n", "\n\nHello!")),
    # the template wrote <think> into the prompt (DeepSeek-R1's, Qwen3.5's): the answer has no opening tag
    ("The user greets me.\n</think>\n\nHello!", ("The user greets me.\n", "\n\nHello!")),
    ("<think>\nStill thinking when the length limit", ("\nStill thinking when the length limit", None)),
    ("No tags at all", ("No tags at all", None)),  # vLLM's too: without </think>, all is reasoning
    ("<think></think>", ("", None)),
    ("<think>\n\n</think>\n\n", ("\n\n", "\n\n")),
    ("", ("", None)),
    ("a</think>b</think>c", ("a", "b</think>c")),  # the first </think> ends it
    ("<think>a<think>b</think>c", ("a<think>b", "c")),  # the model's own <think> is dropped once
    ("x<think>y</think>z", ("xy", "z")),
    ("<think>a < b and c </thin", ("a < b and c </thin", None)),  # a partial tag at the end is text
    ("<think>日本語</think>é", ("日本語", "é")),
]
ALL = [(family, text, want) for family in FAMILIES for text, want in THINKING]


def pieces_of(text: str, points: list[int]) -> list[str]:
    points = sorted({p for p in points if 0 < p < len(text)})
    return [text[a:b] for a, b in itertools.pairwise([0, *points, len(text)])]


def streamed(parser: ReasoningParser, pieces: list[str]) -> tuple[str, str]:
    reasoning, content = [], []
    for p in pieces:
        r, c = parser.feed(p)
        reasoning.append(r)
        content.append(c)
    r, c = parser.finish()
    return "".join(reasoning) + r, "".join(content) + c


def as_streamed(want: tuple[str | None, str | None]) -> tuple[str, str]:
    return want[0] or "", want[1] or ""


@pytest.mark.parametrize(("family", "text", "want"), ALL)
def test_split(family: str, text: str, want: tuple[str | None, str | None]) -> None:
    assert ReasoningParser(family).split(text) == want


@pytest.mark.parametrize(("family", "text", "want"), ALL)
def test_every_split_streams_to_the_whole(family: str, text: str, want: tuple[str | None, str | None]) -> None:
    assert streamed(ReasoningParser(family), list(text)) == as_streamed(want)
    for i, j in itertools.combinations_with_replacement(range(len(text) + 1), 2):
        assert streamed(ReasoningParser(family), [text[:i], text[i:j], text[j:]]) == as_streamed(want), (i, j)


@settings(max_examples=200, deadline=None)
@given(
    parts=st.lists(st.sampled_from(["<think>", "</think>", "<", "</", "think", ">", "a", "\n", "é", "<thi", "</th"])),
    points=st.lists(st.integers(0, 100), max_size=20),
    family=st.sampled_from(FAMILIES),
)
def test_any_answer_streams_to_its_split(parts: list[str], points: list[int], family: str) -> None:
    text = "".join(parts)
    assert streamed(ReasoningParser(family), pieces_of(text, points)) == as_streamed(
        ReasoningParser(family).split(text)
    )


def test_a_partial_tag_waits_and_the_rest_streams_at_once() -> None:
    p = ReasoningParser("qwen3")
    assert p.feed("<think>\nLet me") == ("\nLet me", "")
    assert p.feed(" see </th") == (" see ", "")  # "</th" may be the end tag
    assert p.feed("ink>\n\nIt is") == ("", "\n\nIt is")
    assert p.feed(" 4.</think>") == ("", " 4.</think>")  # once the reasoning ended, all is content
    assert p.finish() == ("", "")


QWEN3 = ChatTemplate((DATA / "qwen3-30b-a3b.jinja").read_text(), eos_token="<|im_end|>")
USER = [ChatMessage("user", "Hi")]


def test_qwen3_without_thinking_answers_in_content() -> None:
    # enable_thinking false: the prompt ends with an empty think block, and the answer is all content
    prompt = QWEN3.render(USER, template_kwargs={"enable_thinking": False})
    assert prompt.endswith("<think>\n\n</think>\n\n")
    for p in (
        ReasoningParser("qwen3", prompt=prompt),
        ReasoningParser("qwen3", template_kwargs={"enable_thinking": False}),
    ):
        assert not p.thinking
        assert p.split("Hello!") == (None, "Hello!")
        assert p.split("") == (None, None)
        assert p.split("<think>x</think>y") == (None, "<think>x</think>y")
        assert streamed(p, ["Hel", "lo!"]) == ("", "Hello!")
    # with thinking (the default, or true), the prompt leaves it to the model
    for kwargs in ({}, {"enable_thinking": True}):
        prompt = QWEN3.render(USER, template_kwargs=kwargs)
        p = ReasoningParser("qwen3", prompt=prompt, template_kwargs=kwargs)
        assert p.thinking and p.split("<think>\nhm\n</think>\n\nHello!") == ("\nhm\n", "\n\nHello!")


def test_deepseek_r1_reads_the_prompt_not_enable_thinking() -> None:
    # vLLM's deepseek_r1 parser has no enable_thinking; a prompt that closed the reasoning still counts
    assert ReasoningParser("deepseek_r1", template_kwargs={"enable_thinking": False}).thinking
    assert not ReasoningParser("deepseek_r1", prompt="<｜Assistant｜><think>\n</think>").thinking
    # DeepSeek-R1's template ends the prompt with "<think>\n": the answer has no opening tag
    assert ReasoningParser("deepseek_r1", prompt="<｜Assistant｜><think>\n").split("hm</think>4") == ("hm", "4")


def test_detect_reasoning() -> None:
    for name, model in MODELS.items():
        assert detect_reasoning((DATA / f"{name}.jinja").read_text()) == model.get("reasoning")
    assert detect_reasoning("{{ content.split('</think>')[-1] }}") == "deepseek_r1"


def test_unknown_family() -> None:
    with pytest.raises(ValueError, match="unknown reasoning family"):
        ReasoningParser("nope")


# ---- reasoning, then tool calls: one Qwen3 answer ------------------------------------------------

TOOLS = [
    ToolSpec("get_weather", "The weather", json.dumps({"type": "object", "properties": {"city": {"type": "string"}}}))
]
ANSWER = (
    "<think>\nThe user wants the weather; I call get_weather.\n</think>\n\n"
    "I will check.\n<tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
)


def test_a_thinking_answer_with_a_tool_call_streams_as_it_parses() -> None:
    prompt = QWEN3.render(USER, tools=TOOLS)
    reasoning, content = ReasoningParser("qwen3", prompt=prompt).split(ANSWER)
    assert reasoning == "\nThe user wants the weather; I call get_weather.\n" and content is not None
    parsed = parser_for("hermes").parse(content)
    assert parsed.content == "\n\nI will check." and [c.name for c in parsed.tool_calls] == ["get_weather"]
    for i, j in itertools.combinations(range(1, len(ANSWER), 5), 2):
        r, t = ReasoningParser("qwen3", prompt=prompt), StreamingToolParser("hermes")
        got_reasoning, deltas = [], []
        for piece in (ANSWER[:i], ANSWER[i:j], ANSWER[j:]):
            dr, dc = r.feed(piece)
            got_reasoning.append(dr)
            deltas += t.feed(dc)
        dr, dc = r.finish()
        deltas += t.feed(dc) + t.finish()
        got = assemble(deltas)
        assert "".join(got_reasoning) + dr == reasoning
        assert got.content == parsed.content
        assert [(c.name, c.arguments) for c in got.tool_calls] == [(c.name, c.arguments) for c in parsed.tool_calls]
