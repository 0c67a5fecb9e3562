"""Tool calls read back from a model's answer (moe_lightning.tool_calls): per format, whole and
streamed (the stream's deltas add up to the parsed answer however the text is cut), round trips
through the published templates (tests/data/chat_templates) and through the grammar's pieces."""

from __future__ import annotations

import itertools
import json
import re
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import jsonschema
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moe_lightning.chat_template import ChatMessage, ChatTemplate, ToolCall, ToolSpec
from moe_lightning.reasoning import ReasoningParser
from moe_lightning.tool_calls import (
    FORMATS,
    ContentDelta,
    ParsedOutput,
    StreamingToolParser,
    ToolCallDelta,
    assemble,
    call_grammar,
    detect_format,
    parser_for,
    render_calls,
)

DATA = Path(__file__).parent / "data" / "chat_templates"
MODELS = json.loads((DATA / "models.json").read_text())


def counter() -> Callable[[], str]:
    n = itertools.count()
    return lambda: f"id{next(n)}"


def parse(fmt: str, text: str) -> ParsedOutput:
    return parser_for(fmt, new_id=counter()).parse(text)


def stream(fmt: str, pieces: list[str]) -> tuple[ParsedOutput, StreamingToolParser, list]:
    s = StreamingToolParser(fmt, new_id=counter())
    deltas = []
    for p in pieces:
        deltas += s.feed(p)
    deltas += s.finish()
    return assemble(deltas), s, deltas


def cuts(text: str, points: list[int]) -> list[str]:
    points = sorted({p for p in points if 0 < p < len(text)})
    return [text[a:b] for a, b in itertools.pairwise([0, *points, len(text)])]


def call(name: str, arguments: str, i: int = 0) -> ToolCall:
    return ToolCall(f"id{i}", name, arguments)


# ---- each format -----------------------------------------------------------------------------------

WEATHER = '{"city": "Paris", "unit": "celsius"}'
HERMES = f'<tool_call>\n{{"name": "get_weather", "arguments": {WEATHER}}}\n</tool_call>'
CASES: dict[str, list[tuple[str, ParsedOutput]]] = {
    "hermes": [
        ("Hello there.", ParsedOutput("Hello there.")),
        ("  spaces kept \n", ParsedOutput("  spaces kept \n")),  # no call: the text as it is
        (HERMES, ParsedOutput("", [call("get_weather", WEATHER)])),
        ("\n\n" + HERMES + "\n", ParsedOutput("", [call("get_weather", WEATHER)])),  # Qwen3's, after </think>
        (
            "Let me look.\n" + HERMES + "\n" + HERMES.replace("Paris", "Rome"),
            ParsedOutput(
                "Let me look.", [call("get_weather", WEATHER), call("get_weather", WEATHER.replace("Paris", "Rome"), 1)]
            ),
        ),
        # arguments first (Hermes 2 Pro's order), compact JSON kept as written, other keys skipped
        (
            '<tool_call>{"arguments":{"a":[1,2.5e-3,true,null]},"id":7,"name":"f"}</tool_call>',
            ParsedOutput("", [call("f", '{"a":[1,2.5e-3,true,null]}')]),
        ),
        # the closing tag may be missing at the end (vLLM reads such a call), and text after a call is content
        ('<tool_call>{"name": "f", "arguments": {}}', ParsedOutput("", [call("f", "{}")])),
        (HERMES + "\nDone.", ParsedOutput("Done.", [call("get_weather", WEATHER)])),
        # a string holding the closing tag does not close the block
        (
            '<tool_call>{"name": "say", "arguments": {"text": "</tool_call>"}}</tool_call>',
            ParsedOutput("", [call("say", '{"text": "</tool_call>"}')]),
        ),
        # not calls: content, word for word
        ("<tool_call> is the tag I use", ParsedOutput("<tool_call> is the tag I use")),
        ("<tool_call>{'name': 'f'}</tool_call>", ParsedOutput("<tool_call>{'name': 'f'}</tool_call>")),
        ('<tool_call>{"name": "f"}</tool_call>', ParsedOutput('<tool_call>{"name": "f"}</tool_call>')),
        ('<tool_call>{"arguments": {}}</tool_call> x', ParsedOutput('<tool_call>{"arguments": {}}</tool_call> x')),
        (
            '<tool_call>{"name": 3, "arguments": {}}</tool_call>',
            ParsedOutput('<tool_call>{"name": 3, "arguments": {}}</tool_call>'),
        ),
        ("a <tool_call", ParsedOutput("a <tool_call")),  # a partial marker at the end is content
        # a block that is no call stays content, the calls around it are calls
        (
            "<tool_call>oops</tool_call>\n" + HERMES,
            ParsedOutput("<tool_call>oops</tool_call>", [call("get_weather", WEATHER)]),
        ),
    ],
    "mistral": [
        ("Plain [answer] with [brackets].", ParsedOutput("Plain [answer] with [brackets].")),
        (
            '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "g", "arguments": {}}]',
            ParsedOutput("", [call("get_weather", '{"city": "Paris"}'), call("g", "{}", 1)]),
        ),
        # v3 with a space (Mixtral 8x22B's), and the "id" Mistral's templates write back
        (
            'Sure. [TOOL_CALLS] [{"name": "f", "arguments": {"x": 1}, "id": "abcdefgh1"}]',
            ParsedOutput("Sure.", [call("f", '{"x": 1}')]),
        ),
        # v11+: name then arguments, [ARGS] between them in v13, one marker per call
        (
            '[TOOL_CALLS]get_weather{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{}',
            ParsedOutput("", [call("get_weather", '{"city": "Paris"}'), call("get_time", "{}", 1)]),
        ),
        ("[TOOL_CALLS] nothing here", ParsedOutput("[TOOL_CALLS] nothing here")),
        ("[TOOL_CALLS][]", ParsedOutput("[TOOL_CALLS][]")),
        ('[TOOL_CALLS][{"name": "f", "arguments": {}}', ParsedOutput("", [call("f", "{}")])),  # no closing bracket
        (
            '[TOOL_CALLS][{"name": "f", "arguments": {}}, 42]',
            ParsedOutput(", 42]", [call("f", "{}")]),
        ),  # a bad second item
    ],
    "llama3_json": [
        (
            '{"name": "get_weather", "parameters": {"city": "Paris"}}',
            ParsedOutput("", [call("get_weather", '{"city": "Paris"}')]),
        ),
        (
            '<|python_tag|>{"name": "f", "arguments": {}}; {"name": "g", "parameters": {"a": 1}}',
            ParsedOutput("", [call("f", "{}"), call("g", '{"a": 1}', 1)]),
        ),
        ('{"answer": 42}', ParsedOutput('{"answer": 42}')),  # a JSON answer: content
        (
            'Sure: {"name": "f", "parameters": {}}',
            ParsedOutput('Sure: {"name": "f", "parameters": {}}'),
        ),  # a call opens the answer or there is none
    ],
}
ALL_CASES = [(fmt, text, want) for fmt, cases in CASES.items() for text, want in cases]


@pytest.mark.parametrize(("fmt", "text", "want"), ALL_CASES)
def test_parse(fmt: str, text: str, want: ParsedOutput) -> None:
    assert parse(fmt, text) == want


@pytest.mark.parametrize(("fmt", "text", "want"), ALL_CASES)
def test_every_split_streams_to_the_parsed_answer(fmt: str, text: str, want: ParsedOutput) -> None:
    assert stream(fmt, list(text))[0] == want  # a character at a time
    for i in range(1, len(text)):  # every cut in two
        assert stream(fmt, [text[:i], text[i:]])[0] == want, i
    for i, j in itertools.combinations(range(1, len(text)), 2) if len(text) < 60 else ():  # and in three
        assert stream(fmt, [text[:i], text[i:j], text[j:]])[0] == want, (i, j)


@settings(max_examples=300, deadline=None)
@given(case=st.sampled_from(ALL_CASES), points=st.lists(st.integers(0, 200), max_size=30))
def test_any_split_streams_to_the_parsed_answer(case: tuple[str, str, ParsedOutput], points: list[int]) -> None:
    fmt, text, want = case
    assert stream(fmt, cuts(text, points))[0] == want


def test_streamed_deltas_are_openai_chunks() -> None:
    _, _, deltas = stream(
        "hermes",
        ["Checking.\n<tool_", 'call>\n{"name": "get_weather", ', '"arguments": {"city"', ': "Paris"}}\n</tool_call>'],
    )
    assert deltas[0] == ContentDelta("Checking.")
    assert deltas[1] == ToolCallDelta(0, "id0", "get_weather")
    assert deltas[1].to_openai() == {
        "index": 0,
        "id": "id0",
        "type": "function",
        "function": {"name": "get_weather", "arguments": ""},
    }
    args = [d for d in deltas[2:] if isinstance(d, ToolCallDelta)]
    assert all(d.id is None and d.name is None and d.index == 0 for d in args) and len(args) == 2
    assert "".join(d.arguments for d in args) == '{"city": "Paris"}'
    assert args[0].to_openai() == {"index": 0, "function": {"arguments": '{"city"'}}


def test_content_is_streamed_as_it_comes_and_only_a_possible_marker_waits() -> None:
    s = StreamingToolParser("hermes")
    assert s.feed("Hello wor") == [ContentDelta("Hello wor")]
    assert s.feed("ld <tool") == [ContentDelta("ld")]  # " <tool" may open a call
    assert s.feed("box>") == [ContentDelta(" <toolbox>")]
    assert s.feed("\n") == []  # whitespace waits: a call may come next, and it would be dropped
    assert s.finish() == [ContentDelta("\n")]  # none came: the text is unchanged


def test_ids() -> None:
    for fmt, pattern in (
        ("hermes", r"call_[A-Za-z0-9]{24}"),
        ("llama3_json", r"call_[A-Za-z0-9]{24}"),
        ("mistral", r"[A-Za-z0-9]{9}"),
    ):
        text = render_calls(fmt, [ToolCall("x", "f", "{}"), ToolCall("x", "g", "{}")])
        calls = parser_for(fmt).parse(text).tool_calls
        assert len(calls) == 2 and all(re.fullmatch(pattern, c.id) for c in calls) and calls[0].id != calls[1].id


# ---- a call that breaks after it was announced --------------------------------------------------

BROKEN = {
    "hermes": [
        '<tool_call>{"name": "f", "arguments": {"a": 1',  # cut short (a length limit)
        '<tool_call>{"name": "f", "arguments": {"a": 1,}}</tool_call>',  # bad JSON
        '<tool_call>{"name": "f", "arguments": {}, "name": "g"}</tool_call>',  # a key twice
        'Text. <tool_call>{"name": "f", "arguments": {}}</tool_call> <tool_call>{"name": "g", "arguments": [}',
    ],
    "mistral": [
        '[TOOL_CALLS][{"name": "f", "arguments": {"a": tru}}]',
        "[TOOL_CALLS]f{",
        '[TOOL_CALLS]f{"a": 1}[TOOL_CALLS]g{"b"',
    ],
    "llama3_json": [
        '{"name": "f", "parameters": {"a": "unterminated',
        '{"name": "f", "parameters": {}, "extra": 1}',  # a key a call has not, after its call started
    ],
}


@pytest.mark.parametrize(("fmt", "text"), [(f, t) for f, ts in BROKEN.items() for t in ts])
def test_a_call_that_breaks_after_it_started_makes_all_content(fmt: str, text: str) -> None:
    # parse() gives the whole text as content, as vLLM does; a stream cannot take back what it sent:
    # it stops there (malformed), having sent the same calls and content for any split
    assert parse(fmt, text) == ParsedOutput(text)
    first, s, _ = stream(fmt, [text])
    assert s.malformed and first.tool_calls
    for i in range(1, len(text)):
        got, s, _ = stream(fmt, [text[:i], text[i:]])
        assert s.malformed and got == first, i


# ---- texts made of pieces, split anywhere --------------------------------------------------------

WORDS = st.sampled_from(["Hi", "the", "<", "[", "{", "}", "tool", "<tool", "[TOOL", "é", "日本"])
SPACES = st.sampled_from(["", " ", "\n", "\n\n", "\t "])
NAMES = st.sampled_from(["get_weather", "f", "search.web", "a-b"])
JSON_VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(10**6), 10**6)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=8,
)
ARGUMENTS = st.dictionaries(st.text(max_size=6), JSON_VALUES, max_size=3).flatmap(
    lambda d: st.sampled_from([json.dumps(d), json.dumps(d, separators=(",", ":")), json.dumps(d, indent=1)])
)


@st.composite
def answers(draw: st.DrawFn, fmt: str) -> str:
    """Content, calls (well formed, or no call at all) and the whitespace between them, in any order."""
    parts = []
    for _ in range(draw(st.integers(0, 4))):
        kind = draw(st.sampled_from(["content", "call", "not a call"]))
        if kind == "content":
            parts.append(" ".join(draw(st.lists(WORDS, min_size=1, max_size=4))))
        elif kind == "call":
            c = ToolCall("x", draw(NAMES), draw(ARGUMENTS))
            if fmt == "hermes":
                body = f'{{"name": {json.dumps(c.name)}, "arguments": {c.arguments}}}'
                parts.append(f"<tool_call>{draw(SPACES)}{body}{draw(SPACES)}</tool_call>")
            elif fmt == "mistral":
                one = draw(st.booleans())
                parts.append(
                    render_calls("mistral", [c])
                    if one
                    else f"[TOOL_CALLS]{c.name}{c.arguments if c.arguments.startswith('{') else '{}'}"
                )
            else:
                parts.append(render_calls("llama3_json", [c]))
        else:
            parts.append(
                draw(
                    st.sampled_from(
                        ["<tool_call>nope</tool_call>", "[TOOL_CALLS] no", '<tool_call>{"x": 1}', "<tool_call"]
                    )
                )
            )
        parts.append(draw(SPACES))
    return "".join(parts)


@pytest.mark.parametrize("fmt", FORMATS)
@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_generated_answers_stream_as_they_parse(fmt: str, data: st.DataObject) -> None:
    text = data.draw(answers(fmt))
    points = data.draw(st.lists(st.integers(0, len(text)), max_size=20))
    want = parse(fmt, text)
    got, s, _ = stream(fmt, cuts(text, points))
    if s.malformed:  # only an answer whose call broke (a generated one never does, but "<tool_call" may start one)
        assert want == ParsedOutput(text)
    else:
        assert got == want
        for c in want.tool_calls:
            json.loads(c.arguments)
    if not want.tool_calls:
        assert want.content == text


# ---- round trips -------------------------------------------------------------------------------------

CALLS = [
    ToolCall("abcdefgh1", "get_weather", '{"city": "Paris", "days": [1, 2], "note": "caf\\u00e9 \\"x\\""}'),
    ToolCall("abcdefgh2", "get_time", "{}"),
]
TOOL_TEMPLATES = sorted(name for name, m in MODELS.items() if m.get("tool_format"))
END_OF_TURN = ("<|im_end|>\n", "</s>", "<|eot_id|>")


def template(name: str) -> ChatTemplate:
    m = MODELS[name]
    return ChatTemplate((DATA / f"{name}.jinja").read_text(), bos_token=m["bos_token"], eos_token=m["eos_token"])


def assistant_text(t: ChatTemplate, calls: list[ToolCall]) -> str:
    """What the template writes for an assistant message of `calls`: the model's answer to read back."""
    user = [ChatMessage("user", "Weather in Paris, and the time?")]
    prompt = t.render(user, add_generation_prompt=True)
    full = t.render([*user, ChatMessage("assistant", "", tool_calls=tuple(calls))], add_generation_prompt=False)
    assert full.startswith(prompt)
    text = full[len(prompt) :]
    for end in END_OF_TURN:
        text = text.removesuffix(end)
    return text


@pytest.mark.parametrize("name", TOOL_TEMPLATES)
def test_calls_rendered_by_the_template_parse_back(name: str) -> None:
    fmt = MODELS[name]["tool_format"]
    t = template(name)
    assert detect_format(t.source) == fmt
    for calls in ([CALLS[0]], CALLS) if name != "llama-3.1-8b-instruct" else ([CALLS[0]],):
        text = assistant_text(t, calls)
        if MODELS[name].get("reasoning"):  # Qwen3 writes the turn's (empty) thinking first
            reasoning, text = ReasoningParser(MODELS[name]["reasoning"]).split(text)
            assert reasoning == "\n\n" and text is not None
        got = parse(fmt, text)
        assert got.content == ""
        assert [(c.name, json.loads(c.arguments)) for c in got.tool_calls] == [
            (c.name, json.loads(c.arguments)) for c in calls
        ]
        # and as it streams, cut anywhere
        for i in range(1, len(text), 3):
            assert stream(fmt, [text[:i], text[i:]])[0] == got


def test_formats_of_the_other_templates() -> None:
    for name in MODELS:
        assert detect_format((DATA / f"{name}.jinja").read_text()) == MODELS[name].get("tool_format")


TOOLS = [
    ToolSpec(
        "get_weather",
        "The weather",
        json.dumps({"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}),
    ),
    ToolSpec("get_time"),
]


@pytest.mark.parametrize("fmt", FORMATS)
def test_what_the_grammar_forces_parses_back(fmt: str) -> None:
    g = call_grammar(fmt, TOOLS, "required")
    key = "parameters" if fmt == "llama3_json" else "arguments"
    objects = [{"name": "get_weather", key: {"city": "Paris"}}, {"name": "get_time", key: {}}]
    for o in objects:
        jsonschema.validate(o, g.schema)
    for bad in (
        {"name": "get_weather", key: {}},
        {"name": "nope", key: {}},
        {"name": "get_time", key: {"x": 1}},
        {"name": "get_time"},
    ):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, g.schema)
    assert g.separator is not None
    for dumps in (json.dumps, lambda o: json.dumps(o, separators=(",", ":")), lambda o: json.dumps(o, indent=2)):
        for n in (1, 2):
            text = g.begin + g.separator.join(dumps(o) for o in objects[:n]) + g.end
            got = parse(fmt, text)
            assert got.content == "" and [c.name for c in got.tool_calls] == ["get_weather", "get_time"][:n]
            assert [json.loads(c.arguments) for c in got.tool_calls] == [o[key] for o in objects[:n]]
            assert stream(fmt, list(text))[0] == got
    assert json.loads(g.source()) == {"begin": g.begin, "separator": g.separator, "end": g.end, "schema": g.schema}


def test_grammar_pieces() -> None:
    assert call_grammar("hermes", TOOLS, "required")[:3] == (
        "<tool_call>\n",
        "\n</tool_call>\n<tool_call>\n",
        "\n</tool_call>",
    )
    assert call_grammar("mistral", TOOLS, "required")[:3] == ("[TOOL_CALLS][", ", ", "]")
    named = call_grammar("hermes", TOOLS, {"type": "function", "function": {"name": "get_weather"}})
    assert named.separator is None  # exactly one call
    assert named.schema == {
        "type": "object",
        "properties": {"name": {"const": "get_weather"}, "arguments": TOOLS[0].parameters_schema()},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }
    required = call_grammar("hermes", TOOLS, "required")
    assert [s["properties"]["name"] for s in required.schema["anyOf"]] == [
        {"const": "get_weather"},
        {"const": "get_time"},
    ]
    assert call_grammar("hermes", TOOLS[:1], "required").schema == named.schema  # one tool: no anyOf
    any_object = call_grammar("hermes", [ToolSpec("f", parameters="{}")], "required").schema
    assert any_object["properties"]["arguments"] == {"type": "object"}  # "parameters": {} asks for no more
    assert call_grammar("hermes", TOOLS, "required", parallel=False).separator is None
    for choice, words in (
        ("auto", "forces no call"),
        ("none", "forces no call"),
        ({"type": "function", "function": {"name": "nope"}}, "not among the tools"),
        ({"function": "x"}, "named tool_choice"),
    ):
        with pytest.raises(ValueError, match=words):
            call_grammar("hermes", TOOLS, choice)
    with pytest.raises(ValueError, match="needs tools"):
        call_grammar("hermes", [], "required")


# ---- cost ----------------------------------------------------------------------------------------


def pieces(text: str, n: int) -> Iterator[str]:
    return (text[i : i + n] for i in range(0, len(text), n))


def test_a_long_answer_streams_in_linear_time() -> None:
    big = json.dumps({"text": "word " * 20000, "list": list(range(5000))})
    text = "Some content first.\n" + render_calls("hermes", [ToolCall("x", "write", big)]) + "\n" + "tail " * 5000
    t0 = time.perf_counter()
    got, s, _ = stream("hermes", list(pieces(text, 4)))  # ~4 characters a token
    took = time.perf_counter() - t0
    print(f"{len(text)} characters streamed in {took * 1000:.0f} ms")
    assert got.tool_calls[0].arguments == big and got.content.startswith("Some content first.")
    assert took < 3.0
    assert len(s._buf) < 100  # what was read is let go


# ---- the JSON check ----------------------------------------------------------------------------------

JSONISH = st.lists(
    st.sampled_from([*'{}[]",:0123456789-+.eE \t\n\\/uabfnrtxé\x01', "true", "false", "null", "NaN", '"k"', "\\u00e9"]),
    min_size=1,
    max_size=14,
).map("".join)


def scanner_says(text: str, points: list[int]) -> bool:
    """Whether text is one JSON value (after which only whitespace), read by _JsonScanner in pieces."""
    from moe_lightning.tool_calls import _DONE, _ERROR, _MORE, _JsonScanner

    scanner, i, status = _JsonScanner(), 0, _MORE
    for end in [*sorted({p for p in points if 0 < p < len(text)}), len(text)]:
        status, i = scanner.scan(text[:end], i)
        if status != _MORE:
            break
    if status == _MORE and scanner.ends_here():
        status, i = _DONE, len(text)
    return status != _ERROR and status == _DONE and text[i:].strip(" \t\n\r") == ""


def json_says(text: str) -> bool:
    def no_constant(name: str) -> None:
        raise ValueError(name)

    try:
        json.loads(text, parse_constant=no_constant)  # strict JSON: no NaN, no Infinity
    except ValueError:
        return False
    return True


@settings(max_examples=3000, deadline=None)
@given(text=JSONISH.filter(lambda t: t[0] not in " \t\n"), points=st.lists(st.integers(0, 14), max_size=4))
def test_the_json_check_agrees_with_json_loads(text: str, points: list[int]) -> None:
    assert scanner_says(text, points) == json_says(text)


@settings(max_examples=300, deadline=None)
@given(value=JSON_VALUES, points=st.lists(st.integers(0, 200), max_size=6))
def test_the_json_check_takes_any_json(value: object, points: list[int]) -> None:
    for text in (json.dumps(value), json.dumps(value, ensure_ascii=False, indent=2)):
        assert scanner_says(text, points)


@pytest.mark.parametrize("fmt", FORMATS)
def test_floods_cost_linear_time(fmt: str) -> None:
    # a model stuck on one character until its length limit: whitespace (held back: a call may come),
    # markers' first characters, or whitespace after a call (a separator may come)
    after_call = render_calls(fmt, [ToolCall("x", "f", "{}")])
    for text in (" \n" * 50000, "<[" * 50000, after_call + "\n" * 100000):
        t0 = time.perf_counter()
        got, _, deltas = stream(fmt, list(text))
        took = time.perf_counter() - t0
        assert took < 3.0, (fmt, text[:10], took)
        assert got == parse(fmt, text)
        assert all(not isinstance(d, ContentDelta) or d.text for d in deltas)
