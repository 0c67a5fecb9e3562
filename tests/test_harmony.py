"""GPT-OSS's harmony format (docs/openai.md, "Harmony"): our chat template (moe_lightning/families/
gpt_oss_template.py) rendered by our renderer as transformers renders it, the `gpt_oss` reasoning split
and the `harmony` tool calls (whole, and streamed however the text is cut), what the template writes
read back by both, and the answer as the gateway reads it, with and without special tokens."""

from __future__ import annotations

import itertools
import json
import time
from collections.abc import Callable, Iterator
from typing import Any

import jinja2
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer
from transformers import PreTrainedTokenizerFast

from gateway.chat_output import ChatOutput
from moe_lightning.chat_template import ChatMessage, ChatTemplate, ChatTemplateError, ToolCall, ToolSpec
from moe_lightning.config.choices import REASONING_FORMATS, TOOL_CALL_FORMATS
from moe_lightning.demo_model import build_tokenizer
from moe_lightning.families.gpt_oss_template import (
    CHAT_TEMPLATE,
    HARMONY_TOKENS,
    REASONING_FORMAT,
    STOP_TOKENS,
    TOOL_CALL_FORMAT,
)
from moe_lightning.reasoning import (
    FAMILIES,
    FORMATS,
    KEEPS_SPECIAL_TOKENS,
    MAX_HEADER,
    HarmonyReader,
    ReasoningParser,
    detect_reasoning,
    parse_header,
)
from moe_lightning.tokenizer import TextTokenizer
from moe_lightning.tool_calls import (
    HARMONY,
    HarmonyStreamingParser,
    ParsedOutput,
    StreamingToolParser,
    assemble,
    call_grammar,
    detect_format,
    parser_for,
    render_calls,
)

# ---- the template: ours against transformers -----------------------------------------------------

WEATHER_SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "description": "A city's name,\nas its people write it"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"], "default": "celsius"},
        "days": {"type": "array", "items": {"type": "integer"}, "default": 1},
        "hourly": {"type": "boolean"},
        "where": {
            "type": "object",
            "properties": {"lat": {"type": "number"}, "lon": {"type": ["number", "null"]}},
            "required": ["lat"],
        },
        "tags": {"type": "array", "items": {"anyOf": [{"type": "string"}, {"const": 3}]}},
        "note": {"type": "string", "nullable": True},
        "any": {},
    },
    "required": ["city"],
}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "The weather", "parameters": WEATHER_SCHEMA},
    },
    {"type": "function", "function": {"name": "get_time", "description": "The time now"}},
    {"type": "function", "function": {"name": "ping", "parameters": {"type": "object", "properties": {}}}},
]
PARIS = {"city": "Paris", "days": [1, 2]}


def assistant_call(*names: str, thinking: str | None = None, content: str = "") -> dict[str, Any]:
    m: dict[str, Any] = {
        "role": "assistant",
        "content": content,
        "tool_calls": [
            {"id": f"call_{n}", "type": "function", "function": {"name": n, "arguments": json.dumps(PARIS)}}
            for n in names
        ],
    }
    if thinking is not None:
        m["reasoning_content"] = thinking
    return m


def tool_result(name: str, content: str) -> dict[str, Any]:
    return {"role": "tool", "tool_call_id": f"call_{name}", "content": content}


# (conversation, tools, chat_template_kwargs): OpenAI's messages, as a client sends them
CHATS: dict[str, tuple[list[dict[str, Any]], list[dict[str, Any]] | None, dict[str, Any]]] = {
    "user": ([{"role": "user", "content": "Hello"}], None, {}),
    "system": ([{"role": "system", "content": "Answer in French."}, {"role": "user", "content": "Hi"}], None, {}),
    "developer": ([{"role": "developer", "content": "Be terse."}, {"role": "user", "content": "Hi"}], None, {}),
    "multi-turn": (
        [
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello!", "reasoning_content": "A greeting."},
            {"role": "user", "content": "Tell me a joke.\nA short one."},
        ],
        None,
        {"reasoning_effort": "low"},
    ),
    "effort high, identity": (
        [{"role": "user", "content": "Hi"}],
        None,
        {"reasoning_effort": "high", "model_identity": "You are a test model."},
    ),
    "tools": ([{"role": "user", "content": "Weather in Paris?"}], TOOLS, {}),
    "tools and system": (
        [{"role": "system", "content": "Use tools."}, {"role": "user", "content": "Weather in Paris?"}],
        TOOLS,
        {},
    ),
    "a tool round": (
        [
            {"role": "user", "content": "Weather in Paris?"},
            assistant_call("get_weather", thinking="I need the weather."),
            tool_result("get_weather", '{"temp": 21}'),
        ],
        TOOLS,
        {},
    ),
    "two calls, a preamble, then a final answer": (
        [
            {"role": "user", "content": "Weather and time?"},
            assistant_call("get_weather", "get_time", thinking="Both.", content="Checking both."),
            tool_result("get_time", "12:00"),
            tool_result("get_weather", "sunny"),
            {"role": "assistant", "content": "Sunny, at noon.", "reasoning_content": "Done."},
            {"role": "user", "content": "Thanks"},
            {"role": "system", "content": "Be kind."},
        ],
        TOOLS,
        {"reasoning_effort": "medium"},
    ),
}


def ours(chat: list[dict[str, Any]]) -> list[ChatMessage]:
    """The messages as the gateway hands them on: a developer message is a system one."""
    return [ChatMessage.from_openai({**m, "role": "system" if m["role"] == "developer" else m["role"]}) for m in chat]


def theirs(chat: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """As transformers is given them: the arguments as values (what vLLM hands its templates)."""
    out = []
    for m in chat:
        m = dict(m)
        if "tool_calls" in m:
            m["tool_calls"] = [
                {**c, "function": {**c["function"], "arguments": json.loads(c["function"]["arguments"])}}
                for c in m["tool_calls"]
            ]
        out.append(m)
    return out


def specs(tools: list[dict[str, Any]] | None) -> list[ToolSpec] | None:
    return None if tools is None else [ToolSpec.from_openai(t) for t in tools]


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    tok = Tokenizer.from_str(build_tokenizer(512, seed=0).to_str())
    tok.add_special_tokens(list(HARMONY_TOKENS))  # as in GPT-OSS's tokenizer
    return tok


@pytest.fixture(scope="module")
def hf(tokenizer: Tokenizer) -> PreTrainedTokenizerFast:
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, chat_template=CHAT_TEMPLATE)


TEMPLATE = ChatTemplate(CHAT_TEMPLATE, origin="gpt_oss_template.CHAT_TEMPLATE")


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("name", sorted(CHATS))
def test_renders_as_transformers_renders_it(
    hf: PreTrainedTokenizerFast, tokenizer: Tokenizer, name: str, add_generation_prompt: bool
) -> None:
    chat, tools, kwargs = CHATS[name]
    text = hf.apply_chat_template(
        theirs(chat), tools=tools, tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs
    )
    got = TEMPLATE.render(ours(chat), add_generation_prompt, tools=specs(tools), template_kwargs=kwargs)
    assert got == text
    ids = hf.apply_chat_template(
        theirs(chat), tools=tools, add_generation_prompt=add_generation_prompt, return_dict=False, **kwargs
    )
    ours_ids = TEMPLATE.prompt_ids(
        TextTokenizer(tokenizer), ours(chat), add_generation_prompt, tools=specs(tools), template_kwargs=kwargs
    )
    assert ours_ids == ids


@pytest.fixture(scope="module")
def renderer() -> Iterator[Any]:
    from moe_lightning.template_renderer import TemplateRenderer

    r = TemplateRenderer(TEMPLATE, max_bytes=1 << 20, processes=1)
    r.start()
    yield r
    r.close()


@pytest.mark.parametrize("name", sorted(CHATS))
def test_the_servers_renderer_processes_render_the_same(hf: PreTrainedTokenizerFast, renderer: Any, name: str) -> None:
    # the orchestrator renders in child processes (moe_lightning.template_renderer): the same text
    chat, tools, kwargs = CHATS[name]
    text = hf.apply_chat_template(theirs(chat), tools=tools, tokenize=False, add_generation_prompt=True, **kwargs)
    assert renderer.render(ours(chat), True, tools=specs(tools), template_kwargs=kwargs) == text


DATE = time.strftime("%Y-%m-%d")


def test_the_format_itself() -> None:
    """The prompt harmony's guide describes, piece by piece (our own example)."""
    chat, tools, _ = CHATS["a tool round"]
    text = TEMPLATE.render(
        [ChatMessage("system", "Be brief."), *ours(chat)],
        tools=specs(tools[1:]),
        template_kwargs={"reasoning_effort": "low"},
    )
    if DATE not in text:  # the day changed between the two clocks
        pytest.skip("rendered at midnight")
    assert text == (
        "<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\n"
        f"Knowledge cutoff: 2024-06\nCurrent date: {DATE}\n\nReasoning: low\n\n"
        "# Valid channels: analysis, commentary, final. Channel must be included for every message.\n"
        "Calls to these tools must go to the commentary channel: 'functions'.<|end|>"
        "<|start|>developer<|message|># Instructions\n\nBe brief.\n\n# Tools\n\n## functions\n\n"
        "namespace functions {\n\n// The time now\ntype get_time = () => any;\n\ntype ping = () => any;\n\n"
        "} // namespace functions<|end|>"
        "<|start|>user<|message|>Weather in Paris?<|end|>"
        "<|start|>assistant<|channel|>analysis<|message|>I need the weather.<|end|>"
        "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
        '{"city": "Paris", "days": [1, 2]}<|call|>'
        '<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>{"temp": 21}<|end|>'
        "<|start|>assistant"
    )


def test_the_tools_as_typescript() -> None:
    text = TEMPLATE.render([ChatMessage("user", "x")], tools=specs(TOOLS[:1]))
    start = text.index("namespace functions {")
    assert text[start : text.index("<|end|>", start)] == (
        "namespace functions {\n\n"
        "// The weather\n"
        "type get_weather = (_: {\n"
        "// A city's name,\n// as its people write it\n"
        "city: string,\n"
        'unit?: "celsius" | "fahrenheit", // default: celsius\n'
        "days?: number[], // default: 1\n"
        "hourly?: boolean,\n"
        "where?: {\nlat: number,\nlon?: number | null,\n},\n"
        "tags?: (string | 3)[],\n"
        "note?: string | null,\n"
        "any?: any,\n"
        "}) => any;\n\n"
        "} // namespace functions"
    )


def test_the_thinking_of_earlier_turns_is_dropped() -> None:
    chat, tools, kwargs = CHATS["two calls, a preamble, then a final answer"]
    text = TEMPLATE.render(ours(chat), tools=specs(tools), template_kwargs=kwargs)
    # a final answer came after the calls: their thinking is dropped, as the final one's is
    assert "Both." not in text and "Done." not in text
    assert "<|start|>assistant<|channel|>commentary<|message|>Checking both.<|end|>" in text  # the preamble
    assert text.count("<|call|>") == 2
    # each result names the call it answers, by id, though they came in another order
    assert text.index("functions.get_time to=assistant") < text.index("functions.get_weather to=assistant")
    assert "<|start|>developer<|message|># Instructions\n\nBe kind.<|end|><|start|>assistant" in text
    # a last assistant turn rendered for training keeps its thinking, and ends with <|return|>
    done = [ChatMessage("user", "Hi"), ChatMessage("assistant", "Hello", reasoning_content="Greet.")]
    assert TEMPLATE.render(done, add_generation_prompt=False).endswith(
        "<|start|>user<|message|>Hi<|end|><|start|>assistant<|channel|>analysis<|message|>Greet.<|end|>"
        "<|start|>assistant<|channel|>final<|message|>Hello<|return|>"
    )


@pytest.mark.parametrize(
    ("chat", "kwargs", "message"),
    [
        ([{"role": "user", "content": "Hi"}], {"reasoning_effort": "max"}, "reasoning_effort must be low"),
        ([{"role": "tool", "tool_call_id": "x", "content": "1"}], {}, "no assistant message before it"),
        ([{"role": "assistant", "content": "<|channel|>final<|message|>x"}], {}, "without harmony's"),
    ],
)
def test_refused_with_the_templates_message(
    hf: PreTrainedTokenizerFast, chat: list[dict[str, Any]], kwargs: dict[str, Any], message: str
) -> None:
    with pytest.raises(jinja2.TemplateError) as theirs_error:
        hf.apply_chat_template(chat, tokenize=False, **kwargs)
    with pytest.raises(ChatTemplateError, match=message) as ours_error:
        TEMPLATE.render(ours(chat), template_kwargs=kwargs)
    assert str(ours_error.value) == str(theirs_error.value)


def test_the_formats_are_read_from_the_template() -> None:
    assert detect_format(CHAT_TEMPLATE) == TOOL_CALL_FORMAT == HARMONY
    assert detect_reasoning(CHAT_TEMPLATE) == REASONING_FORMAT == "gpt_oss"
    assert HARMONY in TOOL_CALL_FORMATS and REASONING_FORMAT in REASONING_FORMATS == FORMATS
    assert REASONING_FORMAT not in FAMILIES  # no <think> tags
    assert REASONING_FORMAT in KEEPS_SPECIAL_TOKENS
    assert set(STOP_TOKENS) <= set(HARMONY_TOKENS)


# ---- the reasoning: gpt_oss ------------------------------------------------------------------------

ANALYSIS = "<|channel|>analysis<|message|>"
FINAL = "<|start|>assistant<|channel|>final<|message|>"
CALL_HEADER = "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
ARGS = '{"city": "Paris"}'
# (answer, (reasoning, content)): the answer starts right after the prompt's <|start|>assistant
SPLITS = [
    (f"{ANALYSIS}User greets.<|end|>{FINAL}Hello!<|return|>", ("User greets.", "Hello!")),
    (f"{ANALYSIS}User greets.<|end|>{FINAL}Hello!", ("User greets.", "Hello!")),  # <|return|> left out (EOS)
    (f"{ANALYSIS}Still thinking when the limit", ("Still thinking when the limit", None)),
    (f"{ANALYSIS}a<|end|><|start|>assistant{ANALYSIS}b<|end|>{FINAL}c", ("a\nb", "c")),  # joined, as vLLM
    ("<|channel|>final<|message|>No thinking.", (None, "No thinking.")),
    # a call goes to the content as written, for the tool parser
    (f"{ANALYSIS}Need it.<|end|>{CALL_HEADER}{ARGS}<|call|>", ("Need it.", f"{CALL_HEADER}{ARGS}<|call|>")),
    (f"{ANALYSIS}Need it.<|end|>{CALL_HEADER}{ARGS}", ("Need it.", f"{CALL_HEADER}{ARGS}")),
    # a preamble is for the user
    (
        f"{ANALYSIS}Plan.<|end|><|start|>assistant<|channel|>commentary<|message|>On it.<|end|>{CALL_HEADER}{{}}",
        ("Plan.", f"On it.{CALL_HEADER}{{}}"),
    ),
    # the recipient in the role's part, first message
    (
        " to=functions.f<|channel|>commentary json<|message|>{}<|call|>",
        (None, " to=functions.f<|channel|>commentary json<|message|>{}<|call|>"),
    ),
    # a built-in tool's call is no answer
    (f"{ANALYSIS}x<|end|><|start|>assistant<|channel|>analysis to=python<|message|>1+1<|call|>", ("x\n1+1", None)),
    (f"{ANALYSIS}a<|end|>stray{FINAL}b", ("a", "strayb")),  # text outside messages is kept
    (f"{ANALYSIS}a{FINAL}b", ("a", "b")),  # a missing <|end|>
    (f"{ANALYSIS}a <|en", ("a <|en", None)),  # a partial marker at the end is text
    ("<|channel|>analysis", (None, "<|channel|>analysis")),  # a header cut short is text
    ("Plain text, no harmony.", (None, "Plain text, no harmony.")),
    ("", (None, None)),
    ("<|start|>assistant<|channel|>final<|message|>日本語<|end|>", (None, "日本語")),
    # decoded without the special tokens (skip_special_tokens): the channels' names are left
    ("analysisUser greets.assistantfinalHello!", ("User greets.", "Hello!")),
    ("analysisa.assistantanalysisb.assistantfinalc", ("a.\nb.", "c")),
    ("finalJust this.", (None, "Just this.")),
    ("analysisCut short while assist", ("Cut short while assist", None)),
]


def pieces_of(text: str, points: list[int]) -> list[str]:
    points = sorted({p for p in points if 0 < p < len(text)})
    return [text[a:b] for a, b in itertools.pairwise([0, *points, len(text)])]


def streamed(parser: ReasoningParser, pieces: list[str]) -> tuple[str | None, str | None]:
    reasoning, content = [], []
    for p in pieces:
        r, c = parser.feed(p)
        reasoning.append(r)
        content.append(c)
    r, c = parser.finish()
    return "".join(reasoning) + r or None, "".join(content) + c or None


@pytest.mark.parametrize(("text", "want"), SPLITS)
def test_split(text: str, want: tuple[str | None, str | None]) -> None:
    assert ReasoningParser("gpt_oss").split(text) == want


@pytest.mark.parametrize(("text", "want"), SPLITS)
def test_streamed_cut_anywhere_adds_up_to_the_split(text: str, want: tuple[str | None, str | None]) -> None:
    assert streamed(ReasoningParser("gpt_oss"), list(text)) == want  # every character apart
    for i, j in itertools.combinations_with_replacement(range(len(text) + 1), 2):
        assert streamed(ReasoningParser("gpt_oss"), [text[:i], text[i:j], text[j:]]) == want, (i, j)


HARMONY_PIECES = st.sampled_from(
    [
        "<|start|>",
        "assistant",
        "<|channel|>",
        "analysis",
        "final",
        "commentary",
        " to=functions.f",
        " to=python",
        " <|constrain|>",
        "json",
        "<|message|>",
        "<|end|>",
        "<|call|>",
        "<|return|>",
        "<|",
        "<",
        "|>",
        "a",
        " ",
        "\n",
        "é",
        "{}",
        "<|sta",
        "<|mess",
    ]
)


@settings(max_examples=300, deadline=None)
@given(parts=st.lists(HARMONY_PIECES, max_size=30), points=st.lists(st.integers(0, 200), max_size=20))
def test_any_answer_streams_to_its_split(parts: list[str], points: list[int]) -> None:
    text = "".join(parts)
    assert streamed(ReasoningParser("gpt_oss"), pieces_of(text, points)) == ReasoningParser("gpt_oss").split(text)


def test_a_prompt_that_opened_the_message() -> None:
    # a prompt that ends inside a message's header's end (a template forcing the final channel)
    p = ReasoningParser(
        "gpt_oss", prompt="<|start|>user<|message|>Hi<|end|><|start|>assistant<|channel|>final<|message|>"
    )
    assert p.split("Hello<|return|>") == (None, "Hello")
    p = ReasoningParser("gpt_oss", prompt="...<|start|>assistant<|channel|>analysis<|message|>")
    assert p.split("hm<|end|><|start|>assistant<|channel|>final<|message|>4") == ("hm", "4")
    # the generation prompt itself leaves the header to the model
    assert ReasoningParser("gpt_oss", prompt="<|start|>assistant").split(f"{ANALYSIS}a<|end|>{FINAL}b") == ("a", "b")
    # reasoning_effort does not turn the reasoning off
    assert ReasoningParser("gpt_oss", template_kwargs={"reasoning_effort": "low"}).thinking


def test_a_header_is_bounded() -> None:
    # "<|start|>" and no <|message|>: past MAX_HEADER it is text, and what follows is read on
    text = "<|start|>" + "x" * MAX_HEADER + FINAL + "ok"
    assert ReasoningParser("gpt_oss").split(ANALYSIS + "r<|end|>" + text) == (
        "r",
        "<|start|>" + "x" * MAX_HEADER + "ok",
    )
    events = HarmonyReader().feed("<|start|>assistant<|channel|>final<|message|>b<|end|>", final=True)
    assert [e.kind for e in events] == ["header", "body", "end"]
    assert events[0].header is not None and events[0].header.channel == "final" and events[2].text == "<|end|>"


@pytest.mark.parametrize(
    ("raw", "role", "channel", "recipient", "content_type"),
    [
        ("<|channel|>analysis<|message|>", None, "analysis", None, None),
        ("<|start|>assistant<|channel|>final<|message|>", "assistant", "final", None, None),
        (
            "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>",
            None,
            "commentary",
            "functions.get_weather",
            "json",
        ),
        (
            "<|start|>assistant to=functions.f<|channel|>commentary json<|message|>",
            "assistant",
            "commentary",
            "functions.f",
            "json",
        ),
        (
            "<|start|>functions.f to=assistant<|channel|>commentary<|message|>",
            "functions.f",
            "commentary",
            "assistant",
            None,
        ),
    ],
)
def test_headers(raw: str, role: str | None, channel: str, recipient: str | None, content_type: str | None) -> None:
    h = parse_header(raw)
    assert (h.raw, h.role, h.channel, h.recipient, h.content_type) == (raw, role, channel, recipient, content_type)


# ---- the tool calls: harmony -----------------------------------------------------------------------


def counter() -> Callable[[], str]:
    n = itertools.count()
    return lambda: f"id{next(n)}"


def parse(text: str) -> ParsedOutput:
    return parser_for(HARMONY, new_id=counter()).parse(text)


def stream(pieces: list[str]) -> tuple[ParsedOutput, StreamingToolParser]:
    s = StreamingToolParser(HARMONY, new_id=counter())
    deltas = []
    for p in pieces:
        deltas += s.feed(p)
    deltas += s.finish()
    return assemble(deltas), s


def call(name: str, arguments: str, i: int = 0) -> ToolCall:
    return ToolCall(f"id{i}", name, arguments)


FIRST_CALL = "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
CALLS = [
    (f"{CALL_HEADER}{ARGS}<|call|>", ParsedOutput("", [call("get_weather", ARGS)])),
    (f"{FIRST_CALL}{ARGS}", ParsedOutput("", [call("get_weather", ARGS)])),  # first message, <|call|> left out
    (f"{FIRST_CALL} \n{ARGS}\n", ParsedOutput("", [call("get_weather", ARGS)])),  # whitespace around is no argument
    (
        "<|start|>assistant to=functions.f<|channel|>commentary json<|message|>{}<|call|>",
        ParsedOutput("", [call("f", "{}")]),
    ),
    (" to=functions.f<|channel|>commentary json<|message|>{}", ParsedOutput("", [call("f", "{}")])),
    ("Let me check.", ParsedOutput("Let me check.")),
    (f"On it.{CALL_HEADER}{ARGS}<|call|>", ParsedOutput("On it.", [call("get_weather", ARGS)])),
    (
        f"{FIRST_CALL}{ARGS}<|call|>{CALL_HEADER.replace('get_weather', 'get_time')}{{}}<|call|>",
        ParsedOutput("", [call("get_weather", ARGS), call("get_time", "{}", 1)]),
    ),
    # a message to no function, or to another tool, is content as written
    (f"{ANALYSIS}hm<|end|>{FINAL}x", ParsedOutput(f"{ANALYSIS}hm<|end|>{FINAL}x")),
    (
        "<|channel|>analysis to=python<|message|>1<|call|>",
        ParsedOutput("<|channel|>analysis to=python<|message|>1<|call|>"),
    ),
    # a whole answer (no reasoning parser): its analysis is content, its call a call
    (
        f"{ANALYSIS}hm<|end|>{CALL_HEADER}{ARGS}<|call|>",
        ParsedOutput(f"{ANALYSIS}hm<|end|>", [call("get_weather", ARGS)]),
    ),
    (f"{FIRST_CALL[:-4]}", ParsedOutput(FIRST_CALL[:-4])),  # a header cut short: no call was announced
    (
        "<|start|>assistant to=functions.<|channel|>x<|message|>{}",
        ParsedOutput("<|start|>assistant to=functions.<|channel|>x<|message|>{}"),
    ),
]
# announced, then broken: the stream ends (malformed), parse() gives it all as content
BROKEN = [
    f'{FIRST_CALL}{{"city": "Par',  # cut short (a length limit)
    f"{FIRST_CALL}not json<|call|>",
    f"{FIRST_CALL}[1]<|call|>",  # arguments are an object
    f"{FIRST_CALL}{{}} and more<|call|>",
    f"{FIRST_CALL}<|call|>",
    f'{FIRST_CALL}{{"a": 1,}}',
]


@pytest.mark.parametrize(("text", "want"), CALLS)
def test_calls(text: str, want: ParsedOutput) -> None:
    assert parse(text) == want
    assert stream(list(text))[0] == want
    for i, j in itertools.combinations_with_replacement(range(len(text) + 1), 2):
        got, s = stream([text[:i], text[i:j], text[j:]])
        assert not s.malformed and got == want, (i, j)


@pytest.mark.parametrize("text", BROKEN)
def test_a_call_broken_after_its_start(text: str) -> None:
    assert parse(text) == ParsedOutput(text)
    whole, s = stream([text])
    assert s.malformed and [c.name for c in whole.tool_calls] == ["get_weather"]
    for i in range(1, len(text)):
        got, s = stream([text[:i], text[i:]])
        assert s.malformed and got == whole, i
    assert s.calls == 1


@settings(max_examples=300, deadline=None)
@given(parts=st.lists(HARMONY_PIECES, max_size=30), points=st.lists(st.integers(0, 200), max_size=20))
def test_any_text_streams_as_it_parses(parts: list[str], points: list[int]) -> None:
    text = "".join(parts)
    want = parse(text)
    got, s = stream(pieces_of(text, points))
    if s.malformed:
        assert want == ParsedOutput(text)
    else:
        assert got == want
        assert want.content == text or want.tool_calls  # no call: the text as it is


def test_the_stream_is_one_type_for_every_format() -> None:
    s = StreamingToolParser(HARMONY)
    assert isinstance(s, HarmonyStreamingParser) and isinstance(parser_for(HARMONY).stream(), StreamingToolParser)
    assert type(StreamingToolParser("hermes")) is StreamingToolParser
    assert s.feed(FIRST_CALL)[0].to_openai()["function"] == {"name": "get_weather", "arguments": ""}
    assert s.feed("{}")[0].arguments == "{}"
    with pytest.raises(ValueError, match="unknown tool call format"):
        parser_for("nope")


def test_rendered_calls_parse_back() -> None:
    calls = [call("get_weather", '{"city": "Paris", "note": "caf\\u00e9"}'), call("get_time", "{}", 1)]
    text = render_calls(HARMONY, calls)
    assert text.startswith(FIRST_CALL) and text.count("<|call|>") == 2
    assert parse(text) == ParsedOutput("", calls)


def test_what_the_grammar_forces_parses_back() -> None:
    tools = specs(TOOLS)
    assert tools is not None
    named = call_grammar(HARMONY, tools, {"type": "function", "function": {"name": "get_weather"}})
    assert named.begin == FIRST_CALL and named.separator is None and named.end == ""
    assert named.schema == WEATHER_SCHEMA
    text = named.begin + json.dumps({"city": "Rome"})
    assert parse(text) == ParsedOutput("", [call("get_weather", '{"city": "Rome"}')])
    one = call_grammar(HARMONY, tools[1:2], "required")
    assert one.begin == FIRST_CALL.replace("get_weather", "get_time") and one.schema["properties"] == {}
    with pytest.raises(ValueError, match="several tools"):
        call_grammar(HARMONY, tools, "required")
    with pytest.raises(ValueError, match="not among the tools"):
        call_grammar(HARMONY, tools, {"type": "function", "function": {"name": "nope"}})
    with pytest.raises(ValueError, match="forces no call"):
        call_grammar(HARMONY, tools, "auto")


def test_the_forced_call_through_the_grammar_library(tokenizer: Tokenizer) -> None:
    from moe_lightning.grammar.compiler import CompiledGrammar
    from moe_lightning.grammar.spec import GrammarKind, GrammarSpec
    from moe_lightning.grammar.vocabulary import GrammarVocabulary

    tools = specs(TOOLS[:1])
    assert tools is not None
    g = call_grammar(HARMONY, tools, "required")
    vocabulary = GrammarVocabulary(tokenizer, tokenizer.get_vocab_size(), [tokenizer.token_to_id("<|call|>")])
    matcher = CompiledGrammar(GrammarSpec(GrammarKind.TOOL_CALLS, g.source()), vocabulary).new_state()._matcher
    # the header's markers are the special tokens themselves (a grammar's quoted text never matches
    # one, and llguidance's mask would allow the token while its consume refused it)
    text = g.begin + json.dumps({"city": "Paris", "days": [2]})
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    assert tokenizer.token_to_id("<|channel|>") == ids[0]
    assert matcher.consume_tokens(ids) and matcher.is_accepting()
    # kept in the decoded text (the server keeps special tokens for harmony), the call reads back
    decoded = TextTokenizer(tokenizer, skip_special_tokens=False).decode(ids)
    assert decoded == text
    assert parse(decoded) == ParsedOutput("", [call("get_weather", '{"city": "Paris", "days": [2]}')])


# ---- what the template writes, read back ---------------------------------------------------------


def answer_of(chat: list[ChatMessage], tools: list[ToolSpec] | None = None) -> str:
    """The assistant's last turn as the template writes it: the text a model answering the prompt
    before it would write (the stop token left out, as the server leaves it out)."""
    prompt = TEMPLATE.render(chat[:-1], tools=tools)
    full = TEMPLATE.render(chat, add_generation_prompt=False, tools=tools)
    assert full.startswith(prompt)
    text = full[len(prompt) :]
    for stop in STOP_TOKENS:
        text = text.removesuffix(stop)
    return text


def test_the_templates_answers_read_back() -> None:
    user = [ChatMessage("user", "Hi")]
    text = answer_of([*user, ChatMessage("assistant", "Hello!", reasoning_content="A greeting.")])
    assert text.startswith(ANALYSIS)
    assert ReasoningParser("gpt_oss").split(text) == ("A greeting.", "Hello!")
    tools = specs(TOOLS)
    calls = (ToolCall("c1", "get_weather", json.dumps(PARIS)), ToolCall("c2", "get_time", "{}"))
    text = answer_of([*user, ChatMessage("assistant", "", tool_calls=calls, reasoning_content="Need both.")], tools)
    reasoning, content = ReasoningParser("gpt_oss").split(text)
    assert reasoning == "Need both." and content is not None
    got = parse(content)
    assert got.content == "" and [(c.name, json.loads(c.arguments)) for c in got.tool_calls] == [
        ("get_weather", PARIS),
        ("get_time", {}),
    ]


# ---- the answer as the gateway reads it ------------------------------------------------------------

ANSWER = f"{ANALYSIS}The user wants the weather.<|end|>{CALL_HEADER}{ARGS}"  # <|call|>: the stop token


def chat_output() -> ChatOutput:
    out = ChatOutput(HARMONY, "gpt_oss", None)
    return out


def test_the_gateways_message_and_stream() -> None:
    out = chat_output()
    message = out.message(ANSWER)
    assert out.called and message["reasoning_content"] == "The user wants the weather."
    assert message["content"] is None
    assert [c["function"] for c in message["tool_calls"]] == [{"name": "get_weather", "arguments": ARGS}]
    for i, j in itertools.combinations(range(0, len(ANSWER), 3), 2):
        s = chat_output()
        deltas = s.feed(ANSWER[:i]) + s.feed(ANSWER[i:j]) + s.feed(ANSWER[j:]) + s.finish()
        reasoning = "".join(d.get("reasoning_content", "") for d in deltas)
        content = "".join(d.get("content", "") for d in deltas)
        calls = [c for d in deltas for c in d.get("tool_calls", [])]
        assert reasoning == message["reasoning_content"] and content == "" and s.called
        assert calls[0]["function"]["name"] == "get_weather"
        assert "".join(c["function"]["arguments"] for c in calls) == ARGS
    # without tools asked, the answer's final channel is the content
    out = ChatOutput("", "gpt_oss", None)
    assert out.message(f"{ANALYSIS}hm<|end|>{FINAL}Hi") == {
        "role": "assistant",
        "reasoning_content": "hm",
        "content": "Hi",
    }


@pytest.mark.parametrize("skip_special_tokens", [False, True])
def test_decoded_with_and_without_special_tokens(tokenizer: Tokenizer, skip_special_tokens: bool) -> None:
    # The markers are special tokens: the gateway's text has them only where it asks to keep them
    # (skip_special_tokens false, as it asks with tools); either way the split is the same
    text = f"{ANALYSIS}User greets.<|end|>{FINAL}Hello there!"
    tok = TextTokenizer(tokenizer, skip_special_tokens=skip_special_tokens)
    decoded = tok.decode(tok.encode(text, add_special_tokens=False))
    assert decoded == (("analysisUser greets.assistantfinalHello there!") if skip_special_tokens else text)
    assert ReasoningParser("gpt_oss").split(decoded) == ("User greets.", "Hello there!")


def test_floods_cost_linear_time() -> None:
    # a model stuck on one character until its length limit, in each place text is held back
    for text in (
        " " * 100000,
        "<" * 100000,
        ANALYSIS + "<|" * 50000,
        "<|start|>" * 20000,
        FIRST_CALL + "[" * 100000,
        ANALYSIS + "assist" * 20000,
        "analysis" + "assistan" * 20000,
    ):
        t0 = time.perf_counter()
        r = ReasoningParser("gpt_oss")
        pieces = [text[i : i + 3] for i in range(0, len(text), 3)]
        got = streamed(r, pieces)
        s = StreamingToolParser(HARMONY)
        deltas = [d for p in pieces for d in s.feed(p)] + s.finish()
        took = time.perf_counter() - t0
        assert took < 5.0, (text[:20], took)
        assert got == ReasoningParser("gpt_oss").split(text)
        assert (assemble(deltas) == parse(text)) or s.malformed
