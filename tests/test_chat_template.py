"""Chat templates: our rendering against transformers' `apply_chat_template`, on the real templates
of the models we serve (tests/data/chat_templates, sources in its models.json)."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import jinja2
import pytest
from tokenizers import Tokenizer
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from moe_lightning.chat_template import (
    ChatMessage,
    ChatTemplate,
    ChatTemplateError,
    ToolCall,
    ToolSpec,
    check_template_kwargs,
    content_text,
)
from moe_lightning.client import Prompt
from moe_lightning.demo_model import build_tokenizer, write_demo_model
from moe_lightning.tokenizer import TextTokenizer
from moe_lightning.validation import RequestLimits
from orchestrator.api import GenerationServicer

DATA = Path(__file__).parent / "data" / "chat_templates"
MODELS = json.loads((DATA / "models.json").read_text())

CHATS = {
    "user": [("user", "Hello, how are you?")],
    "system+user": [("system", "You are a pirate. Answer in one line."), ("user", "Where is the treasure?")],
    "multi-turn": [("user", "Hi!"), ("assistant", "Hello. What can I do for you?"), ("user", "Tell me a joke.")],
}
# The release template of Mixtral refuses a system message; transformers raises its message too
REFUSED = {("mixtral-8x7b-instruct-v0.1-2023", "system+user")}
# Control tokens the templates write: special in the real tokenizers, so they must be here too
MARKERS = ("<|im_start|>", "<|im_end|>", "<|endoftext|>")


def as_messages(chat: list[tuple[str, str]]) -> list[ChatMessage]:
    return [ChatMessage(role, content) for role, content in chat]


def as_dicts(chat: list[tuple[str, str]]) -> list[dict[str, str]]:
    return [{"role": role, "content": content} for role, content in chat]


def server_ids(
    template: ChatTemplate, tokenizer: TextTokenizer, chat: list[tuple[str, str]], renderer: Any = None
) -> list[int]:
    """The token ids the gRPC API makes of a `messages` prompt: its own path (checks, the render in
    process or in `renderer`, the encoding), with a stand-in scheduler that only lends the tokenizer."""
    servicer = GenerationServicer(workers=1)
    servicer.scheduler = SimpleNamespace(tokenizer=tokenizer)  # type: ignore[assignment]
    servicer.chat_template, servicer.renderer = template, renderer
    m = Prompt(messages=as_dicts(chat)).to_pb().messages
    return servicer._chat_prompt(m, RequestLimits(vocab_size=1 << 20, max_context=1 << 20, max_prompt_tokens=8192))


@pytest.fixture(scope="module")
def base_tokenizer() -> str:
    return build_tokenizer(512, seed=0).to_str()


class Setup:
    """One model: transformers' tokenizer with the model's template and tokens, and ours over the
    same tokenizer.json, so any difference comes from the rendering or the BOS handling."""

    def __init__(self, base: str, name: str) -> None:
        model = MODELS[name]
        self.source = (DATA / f"{name}.jinja").read_text(encoding="utf-8")
        self.bos, self.eos = model["bos_token"], model["eos_token"]
        tok = Tokenizer.from_str(base)
        tok.add_special_tokens([t for t in (self.bos, self.eos, *MARKERS, *model.get("control_tokens", ())) if t])
        self.hf = PreTrainedTokenizerFast(
            tokenizer_object=tok, bos_token=self.bos, eos_token=self.eos, chat_template=self.source
        )
        self.ours = TextTokenizer(Tokenizer.from_str(tok.to_str()))
        self.template = ChatTemplate(self.source, bos_token=self.bos, eos_token=self.eos, origin=name)


@pytest.fixture(scope="module")
def setups(base_tokenizer: str) -> dict[str, Setup]:
    return {name: Setup(base_tokenizer, name) for name in MODELS}


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("chat", sorted(CHATS))
@pytest.mark.parametrize("name", sorted(MODELS))
def test_matches_transformers(setups: dict[str, Setup], name: str, chat: str, add_generation_prompt: bool) -> None:
    s = setups[name]
    messages, dicts = as_messages(CHATS[chat]), as_dicts(CHATS[chat])
    if (name, chat) in REFUSED:
        with pytest.raises(jinja2.TemplateError) as theirs:
            s.hf.apply_chat_template(dicts, tokenize=False, add_generation_prompt=add_generation_prompt)
        with pytest.raises(ChatTemplateError) as ours:
            s.template.render(messages, add_generation_prompt)
        assert str(ours.value) == str(theirs.value) != ""
        return
    text = s.hf.apply_chat_template(dicts, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert s.template.render(messages, add_generation_prompt) == text
    ids = s.hf.apply_chat_template(dicts, tokenize=True, add_generation_prompt=add_generation_prompt, return_dict=False)
    assert s.template.prompt_ids(s.ours, messages, add_generation_prompt) == ids
    if add_generation_prompt:  # what the server renders (a prompt to answer), by the server's own path
        assert server_ids(s.template, s.ours, CHATS[chat]) == ids


@pytest.mark.parametrize("name", ["mixtral-8x7b-instruct-v0.1", "mixtral-8x7b-instruct-v0.1-2023"])
def test_one_bos_where_the_template_writes_it(setups: dict[str, Setup], name: str) -> None:
    s = setups[name]
    messages = as_messages(CHATS["multi-turn"])
    bos = s.hf.convert_tokens_to_ids(s.bos)
    ids = s.template.prompt_ids(s.ours, messages)
    assert ids[0] == bos and ids.count(bos) == 1
    # what prompt_ids exists to prevent: the tokenizer adding its BOS in front of the template's
    assert s.ours.encode(s.template.render(messages))[:2] == [bos, bos]


def test_olmoe_bos_is_not_doubled(setups: dict[str, Setup]) -> None:
    s = setups["olmoe-1b-7b-0924-instruct"]
    ids = s.template.prompt_ids(s.ours, as_messages(CHATS["user"]))
    endoftext = s.hf.convert_tokens_to_ids("<|endoftext|>")
    assert ids[0] == endoftext and ids[1] != endoftext and s.hf.convert_tokens_to_ids("<s>") not in ids


@pytest.mark.parametrize("name", ["qwen3-30b-a3b", "dbrx-instruct"])
def test_no_bos_where_the_template_writes_none(setups: dict[str, Setup], name: str) -> None:
    s = setups[name]
    ids = s.template.prompt_ids(s.ours, as_messages(CHATS["user"]))
    assert ids[0] == s.hf.convert_tokens_to_ids("<|im_start|>")


def test_role_order_refused_with_the_templates_message(setups: dict[str, Setup]) -> None:
    s = setups["mixtral-8x7b-instruct-v0.1"]
    chat = [("user", "one"), ("user", "two")]
    with pytest.raises(jinja2.TemplateError) as theirs:
        s.hf.apply_chat_template(as_dicts(chat), tokenize=False)
    with pytest.raises(ChatTemplateError, match="conversation roles must alternate") as ours:
        s.template.render(as_messages(chat))
    assert str(ours.value) == str(theirs.value)


def test_template_globals_and_filters_match_transformers(base_tokenizer: str) -> None:
    source = (
        "{% generation %}{{ messages | tojson }}|{{ {'a': '<b> & c'} | tojson(indent=2) }}{% endgeneration %}"
        "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}[{{ m.content }}]{% endfor %}"
        "{{ strftime_now('%Y') }}{{ bos_token }}{% if tools is defined and tools is none %}T{% endif %}"
    )
    hf = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(base_tokenizer), chat_template=source)
    chat = [("user", "héllo <wörld>"), ("assistant", "second")]
    ours = ChatTemplate(source)  # no BOS: an unset token renders as nothing, not "None"
    assert ours.render(as_messages(chat)) == hf.apply_chat_template(as_dicts(chat), tokenize=False)


def test_demo_model_template(tmp_path: Path) -> None:
    model = write_demo_model(tmp_path / "demo", "tiny", seed=0, progress=False)
    template = ChatTemplate.from_model_dir(model)
    assert template is not None and template.bos_token == "<s>" and template.eos_token == "</s>"
    chat = CHATS["multi-turn"]
    text = template.render(as_messages(chat))
    assert text == (
        "<s><|im_start|>user\nHi!</s>\n<|im_start|>assistant\nHello. What can I do for you?</s>\n"
        "<|im_start|>user\nTell me a joke.</s>\n<|im_start|>assistant\n"
    )
    hf = AutoTokenizer.from_pretrained(model)
    assert text == hf.apply_chat_template(as_dicts(chat), tokenize=False, add_generation_prompt=True)
    tokenizer = TextTokenizer.from_model_dir(model)
    assert tokenizer is not None
    ids = template.prompt_ids(tokenizer, as_messages(chat))
    assert ids == hf.apply_chat_template(as_dicts(chat), add_generation_prompt=True, return_dict=False)
    assert ids[0] == 1 and ids[1] != 1  # one BOS
    assert tokenizer.encode("Hi!") == [1, *tokenizer.encode("Hi!", add_special_tokens=False)]


# -- loading ---------------------------------------------------------------------------------------


def write_config(model_dir: Path, **fields: object) -> Path:
    model_dir.mkdir(parents=True, exist_ok=True)
    (model_dir / "tokenizer_config.json").write_text(json.dumps(fields))
    return model_dir


def render_user(template: ChatTemplate | None) -> str:
    assert template is not None
    return template.render([ChatMessage("user", "hi")])


def test_load_string_form_and_added_token_dicts(tmp_path: Path) -> None:
    d = write_config(
        tmp_path,
        chat_template="{{ bos_token }}{{ messages[0].content }}{{ eos_token }}",
        bos_token={"__type": "AddedToken", "content": "<s>", "lstrip": False},
        eos_token="</s>",
    )
    assert render_user(ChatTemplate.from_model_dir(d)) == "<s>hi</s>"


def test_load_without_special_tokens(tmp_path: Path) -> None:
    d = write_config(tmp_path, chat_template="[{{ bos_token }}]{{ messages[0].content }}", bos_token=None)
    assert render_user(ChatTemplate.from_model_dir(d)) == "[]hi"


def test_load_list_form_uses_default(tmp_path: Path) -> None:
    named = [{"name": "tool_use", "template": "tools"}, {"name": "default", "template": "plain"}]
    assert render_user(ChatTemplate.from_model_dir(write_config(tmp_path, chat_template=named))) == "plain"


def test_load_list_form_with_one_template(tmp_path: Path) -> None:
    d = write_config(tmp_path, chat_template=[{"name": "rag", "template": "only"}])
    assert render_user(ChatTemplate.from_model_dir(d)) == "only"


def test_load_list_form_without_default_is_refused(tmp_path: Path) -> None:
    named = [{"name": "tool_use", "template": "a"}, {"name": "rag", "template": "b"}]
    with pytest.raises(ChatTemplateError, match=r"\['rag', 'tool_use'\].*--chat-template"):
        ChatTemplate.from_model_dir(write_config(tmp_path, chat_template=named))


def test_load_jinja_file(tmp_path: Path) -> None:
    d = write_config(tmp_path, eos_token="</s>")
    (d / "chat_template.jinja").write_text("file:{{ messages[0].content }}{{ eos_token }}")
    assert render_user(ChatTemplate.from_model_dir(d)) == "file:hi</s>"


def test_jinja_file_wins_over_config_as_in_transformers(tmp_path: Path) -> None:
    model = write_demo_model(tmp_path / "demo", "tiny", seed=0, progress=False)
    (model / "chat_template.jinja").write_text("file:{{ messages[0].content }}")
    assert AutoTokenizer.from_pretrained(model).chat_template == "file:{{ messages[0].content }}"
    assert render_user(ChatTemplate.from_model_dir(model)) == "file:hi"


def test_override_wins(tmp_path: Path) -> None:
    d = write_config(tmp_path / "model", chat_template="config", bos_token="<s>")
    (d / "chat_template.jinja").write_text("file")
    override = tmp_path / "mine.jinja"
    override.write_text("override{{ bos_token }}")
    assert render_user(ChatTemplate.from_model_dir(d, override=override)) == "override<s>"


def test_missing_override_is_named(tmp_path: Path) -> None:
    with pytest.raises(ChatTemplateError, match=r"nope\.jinja: cannot read chat template"):
        ChatTemplate.from_model_dir(write_config(tmp_path / "m"), override=tmp_path / "nope.jinja")


def test_no_template(tmp_path: Path) -> None:
    assert ChatTemplate.from_model_dir(write_config(tmp_path / "a", bos_token="<s>")) is None
    (tmp_path / "b").mkdir()
    assert ChatTemplate.from_model_dir(tmp_path / "b") is None


def test_syntax_error_names_file_and_line(tmp_path: Path) -> None:
    d = write_config(tmp_path, chat_template="line one\n{% for m in messages %}{{ m.content }}")
    with pytest.raises(ChatTemplateError, match=r"tokenizer_config\.json: chat_template: .*line 2.*endfor"):
        ChatTemplate.from_model_dir(d)


def test_malformed_tokenizer_config(tmp_path: Path) -> None:
    (tmp_path / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(ChatTemplateError, match="cannot read tokenizer config"):
        ChatTemplate.from_model_dir(tmp_path)


# -- messages ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("role", ["developer", "function", "User", ""])
def test_bad_role(role: str) -> None:
    with pytest.raises(ChatTemplateError, match="roles allowed are system, user, assistant, tool"):
        ChatMessage(role, "x")


def test_empty_chat() -> None:
    with pytest.raises(ChatTemplateError, match="at least one message"):
        ChatTemplate("x").render([])


def test_content_text_parts() -> None:
    assert content_text("plain") == "plain"
    assert content_text([{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]) == "a\nb"
    message = ChatMessage.from_openai({"role": "user", "content": [{"type": "text", "text": "hi"}]})
    assert message == ChatMessage("user", "hi")


@pytest.mark.parametrize(
    "content",
    [
        [{"type": "text", "text": "look"}, {"type": "image_url", "image_url": {"url": "data:..."}}],
        [{"type": "input_audio", "input_audio": {}}],
        ["not a part"],
    ],
)
def test_non_text_parts_are_refused(content: list) -> None:
    with pytest.raises(ChatTemplateError, match="only text content parts are supported"):
        content_text(content)


@pytest.mark.parametrize("content", [None, 42, {"type": "text", "text": "x"}, [{"type": "text"}]])
def test_malformed_content(content: object) -> None:
    with pytest.raises(ChatTemplateError):
        ChatMessage.from_openai({"role": "user", "content": content})


# -- bounds: a template is the checkpoint's code (issue 27, item 4) ---------------------------------

USER = [ChatMessage("user", "hi")]


@pytest.mark.parametrize(
    "statement",
    [
        "{% include 'other.jinja' %}",
        "{% import 'macros.jinja' as m %}",
        "{% from 'm.jinja' import x %}",
        "{% extends 'base.jinja' %}",
    ],
)
def test_templates_that_load_others_are_refused_at_load(tmp_path: Path, statement: str) -> None:
    d = write_config(tmp_path, chat_template="{{ bos_token }}\n" + statement)
    with pytest.raises(ChatTemplateError) as info:
        ChatTemplate.from_model_dir(d)
    assert str(info.value).startswith(
        f"{d / 'tokenizer_config.json'}: chat_template: chat templates may not include, import or extend other "
        "templates (line 2: {% "
    )


def test_loading_runs_none_of_the_template() -> None:
    # compiling evaluates constant expressions, filters included: 100 MB and seconds, in the server, at
    # start-up; it is left to the first render (in a renderer process, under its limits)
    t0 = time.monotonic()
    ChatTemplate("{{ 'x' | center(10**8) }}{{ 'y' * 10**8 }}")
    assert time.monotonic() - t0 < 0.2


@pytest.mark.parametrize(
    ("source", "words"),
    [
        ("{{ nope.attr }}", "the chat template cannot render this conversation: 'nope' is undefined"),
        ("{{ ''.__class__.__mro__ }}", "the chat template cannot render this conversation: access to attribute"),
        ("{{ 1 + 'a' }}", "the chat template failed on this conversation: TypeError: "),
        ("{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}", "the chat template recursed too deeply"),
    ],
)
def test_render_errors_are_the_clients_and_name_no_server_path(source: str, words: str) -> None:
    origin = "/srv/models/private-checkpoint/chat_template.jinja"
    with pytest.raises(ChatTemplateError) as info:
        ChatTemplate(source, origin=origin).render(USER)
    assert str(info.value).startswith(words)
    assert "/srv" not in str(info.value) and "private-checkpoint" not in str(info.value)


def test_a_render_is_cut_at_its_size_bound_as_it_streams() -> None:
    t = ChatTemplate("{% for i in range(20000) %}{{ 'y' * 1000 }}{% endfor %}")  # 20 MB
    t0 = time.monotonic()
    with pytest.raises(
        ChatTemplateError, match="^the chat template rendered this conversation to more than 65536 bytes"
    ):
        t.render(USER, max_bytes=65536)
    assert time.monotonic() - t0 < 0.5
    wide = ChatTemplate("{{ 'é' * 40 }}")  # 40 characters, 80 bytes: the bound is in bytes
    assert wide.render(USER, max_bytes=80) == "é" * 40
    with pytest.raises(ChatTemplateError, match="more than 79 bytes"):
        wide.render(USER, max_bytes=79)


def test_a_huge_repeat_or_power_is_refused_before_it_is_computed() -> None:
    t0 = time.monotonic()
    for source, words in (
        ("{{ 'x' * 10**8 }}", "repeats a value to one of 100000000 characters or items, more than the 65536 bytes"),
        ("{{ (10**7 * [0]) | length }}", "repeats a value to one of 10000000 characters or items"),
        ("{{ 3 ** 1000000 }}", "computes a number of about 2000000 bits"),
    ):
        with pytest.raises(ChatTemplateError, match=words):
            ChatTemplate(source).render(USER, max_bytes=65536)
    assert time.monotonic() - t0 < 0.5
    # within the bound, and without one, the operators are Python's (transformers' renders)
    assert ChatTemplate("{{ 'ab' * 3 }}{{ 2 ** 10 }}{{ [1] * 2 }}").render(USER, max_bytes=100) == "ababab1024[1, 1]"
    assert ChatTemplate("{{ 'ab' * 100 }}").render(USER) == "ab" * 100


# -- the renderer processes (moe_lightning.template_renderer) ----------------------------------------

BRANCHED = (
    "{% if messages[0].content == 'loop' %}{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}"
    "{% endfor %}{% elif messages[0].content == 'memory' %}{{ 'x'.center(10**10) }}"
    "{% else %}{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}{% endif %}"
)


KILLED: list[str] = []  # the reasons the module's renderer gave for the renders it killed (on_killed)


@pytest.fixture(scope="module")
def renderer() -> Iterator[Any]:
    from moe_lightning.template_renderer import TemplateRenderer

    r = TemplateRenderer(
        ChatTemplate(BRANCHED, origin="/srv/models/x/t.jinja"), max_bytes=65536, timeout=1.0, on_killed=KILLED.append
    )
    r.start()
    yield r
    r.close()


@pytest.mark.parametrize("name", sorted(MODELS))
def test_the_renderer_processes_match_transformers(setups: dict[str, Setup], name: str) -> None:
    from moe_lightning.template_renderer import TemplateRenderer

    s = setups[name]
    r = TemplateRenderer(s.template, max_bytes=1 << 20, processes=1)
    r.start()
    try:
        for chat, add in [(c, a) for c in sorted(CHATS) for a in (True, False)]:
            dicts = as_dicts(CHATS[chat])
            if (name, chat) in REFUSED:
                with pytest.raises(jinja2.TemplateError) as theirs:
                    s.hf.apply_chat_template(dicts, tokenize=False, add_generation_prompt=add)
                with pytest.raises(ChatTemplateError) as ours:
                    r.render(as_messages(CHATS[chat]), add)
                assert str(ours.value) == str(theirs.value)
                continue
            want = s.hf.apply_chat_template(dicts, tokenize=False, add_generation_prompt=add)
            assert r.render(as_messages(CHATS[chat]), add) == want
            if add:  # the server's path: this renderer's text, to ids as the server encodes it
                ids = s.hf.apply_chat_template(dicts, tokenize=True, add_generation_prompt=True, return_dict=False)
                assert server_ids(s.template, s.ours, CHATS[chat], renderer=r) == ids
    finally:
        r.close()


def test_a_looping_render_is_killed_at_its_time_limit(renderer: Any) -> None:
    pids = renderer.pids()
    KILLED.clear()
    t0 = time.monotonic()
    with pytest.raises(ChatTemplateError, match="^the chat template took longer than 1 s to render this conversation$"):
        renderer.render([ChatMessage("user", "loop")])
    assert KILLED == ["timeout"]  # moe_lightning_chat_template_renders_killed_total{reason="timeout"}
    assert 0.9 < time.monotonic() - t0 < 2.0
    gone = [p for p in pids if p not in renderer.pids()]
    assert len(gone) == 1 and not Path(f"/proc/{gone[0]}").exists()  # killed and reaped
    assert renderer.render([ChatMessage("user", "hi")]) == "[user] hi\n"  # the other, or its replacement


def test_a_memory_bomb_gets_an_error_not_the_hosts_memory(renderer: Any) -> None:
    t0 = time.monotonic()
    with pytest.raises(ChatTemplateError, match="^the chat template ran out of memory on this conversation$"):
        renderer.render([ChatMessage("user", "memory")])  # 10 GB in one C call, over RLIMIT_AS
    assert time.monotonic() - t0 < 1.0
    assert renderer.render([ChatMessage("user", "hi")]) == "[user] hi\n"


def test_a_cancelled_render_is_killed(renderer: Any) -> None:
    cancel = threading.Event()
    threading.Timer(0.2, cancel.set).start()
    KILLED.clear()
    t0 = time.monotonic()
    with pytest.raises(ChatTemplateError, match="cancelled"):
        renderer.render([ChatMessage("user", "loop")], cancel=cancel)
    assert time.monotonic() - t0 < 0.6
    assert KILLED == ["cancelled"]


def test_a_memory_error_kills_no_renderer(renderer: Any) -> None:
    # MemoryError is the render's, reported by the renderer that lives on: no renderer is killed for it
    KILLED.clear()
    pids = renderer.pids()
    with pytest.raises(ChatTemplateError, match="ran out of memory"):
        renderer.render([ChatMessage("user", "memory")])
    assert KILLED == [] and set(pids) <= set(renderer.pids())  # (a replacement may have joined them)


def test_a_renderer_that_dies_mid_render_is_counted_as_crashed(renderer: Any) -> None:
    from moe_lightning.template_renderer import TemplateRenderer

    KILLED.clear()
    r = TemplateRenderer(ChatTemplate(BRANCHED), max_bytes=65536, timeout=5.0, processes=1, on_killed=KILLED.append)
    r.start()
    try:
        (w,) = r._all
        send = w.send

        def send_then_die(payload: bytes) -> None:
            send(payload)
            time.sleep(0.2)  # past the retry window: this render was under way when its renderer died
            w.proc.kill()

        w.send = send_then_die
        with pytest.raises(ChatTemplateError, match="renderer crashed"):
            r.render([ChatMessage("user", "loop")])
        assert KILLED == ["crashed"]
    finally:
        r.close()


def test_a_render_that_ends_as_close_runs_leaves_no_process() -> None:
    # the render's reply arrives, then close() kills every renderer and drains the idle ones, then the
    # render hands its renderer back: that one must be reaped, not left on the idle queue (a zombie
    # and two pipes, after shutdown)
    from moe_lightning.template_renderer import TemplateRenderer

    r = TemplateRenderer(ChatTemplate(BRANCHED), max_bytes=65536, processes=1)
    r.start()
    (w,) = r._all
    receive = w.receive

    def receive_then_close(*args: Any) -> tuple[int, bytes]:
        reply = receive(*args)
        r.close()
        return reply

    w.receive = receive_then_close
    assert r.render([ChatMessage("user", "hi")]) == "[user] hi\n"  # its reply came before the close
    assert w.proc.returncode is not None  # reaped: no zombie left in /proc
    assert not Path(f"/proc/{w.proc.pid}").exists()
    assert w.proc.stdin is not None and w.proc.stdin.closed and w.proc.stdout is not None and w.proc.stdout.closed
    r.close()  # idempotent, and nothing was left on the idle queue for it


@pytest.mark.parametrize("value", ["0", "-1", "nan", "inf", "soon"])
def test_a_bad_chat_template_timeout_is_refused_at_parse_time(value: str, capsys: pytest.CaptureFixture[str]) -> None:
    from orchestrator.server import build_parser

    base = ["--weight-store", "w", "--gpu-expert", "g", "--cpu-attention", "c"]
    with pytest.raises(SystemExit) as info:
        build_parser().parse_args([*base, "--chat-template-timeout", value])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "--chat-template-timeout" in err and "a positive number of seconds" in err, err
    assert build_parser().parse_args([*base, "--chat-template-timeout", "0.5"]).chat_template_timeout == 0.5


def test_a_bad_chat_template_timeout_from_the_environment_is_refused(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from orchestrator.server import build_parser

    monkeypatch.setenv("MOE_LIGHTNING_CHAT_TEMPLATE_TIMEOUT", "0")
    with pytest.raises(SystemExit) as info:
        build_parser()
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "MOE_LIGHTNING_CHAT_TEMPLATE_TIMEOUT" in err and "a positive number of seconds" in err, err


def test_the_renderer_costs_about_a_millisecond(renderer: Any) -> None:
    chat = as_messages(CHATS["multi-turn"])
    in_process = ChatTemplate(BRANCHED)
    assert renderer.render(chat) == in_process.render(chat)
    timings = {}
    for name, render in (("in process", in_process.render), ("renderer", renderer.render)):
        t0 = time.perf_counter()
        for _ in range(300):
            render(chat)
        timings[name] = (time.perf_counter() - t0) / 300
    print(f"render: {timings['in process'] * 1e6:.0f} us in process, {timings['renderer'] * 1e6:.0f} us in a renderer")
    assert timings["renderer"] - timings["in process"] < 0.005  # ~0.15 ms measured (2 loaded cores)


def test_close_ends_renders_in_flight_at_once() -> None:
    from moe_lightning.service.errors import ShuttingDownError
    from moe_lightning.template_renderer import TemplateRenderer

    r = TemplateRenderer(ChatTemplate(BRANCHED), max_bytes=65536, timeout=30.0)
    r.start()
    pids = r.pids()
    errors: list[BaseException] = []

    def render() -> None:
        try:
            r.render([ChatMessage("user", "loop")])
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=render) for _ in range(2)]
    for t in threads:
        t.start()
    time.sleep(0.3)
    t0 = time.monotonic()
    r.close()
    for t in threads:
        t.join(5)
    assert time.monotonic() - t0 < 1.0 and len(errors) == 2
    assert all(isinstance(e, ShuttingDownError) for e in errors), errors
    assert not [p for p in pids if Path(f"/proc/{p}").exists()]


@pytest.mark.parametrize(
    ("source", "words"),
    [
        ("{{ raise_exception('no chat here') }}", "no chat here"),
        ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}", "took longer than 0.5 s"),
        ("{{ 'x' * 10**9 }}", "repeats a value"),
        ("{% block a %}{% endblock %}{% block a %}{% endblock %}", "syntax error"),  # found by the compiler
    ],
)
def test_a_template_that_fails_a_one_message_chat_fails_at_start(source: str, words: str) -> None:
    from moe_lightning.template_renderer import TemplateRenderer

    r = TemplateRenderer(ChatTemplate(source, origin="/models/m/chat_template.jinja"), max_bytes=65536, timeout=0.5)
    with pytest.raises(ChatTemplateError) as info:
        r.start()
    assert str(info.value).startswith("/models/m/chat_template.jinja: ") and words in str(info.value)
    assert r.pids() == []


# -- tools, tool calls and template arguments (docs/openai.md) ---------------------------------------

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The current weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "description": "The city's name"}},
                "required": ["city"],
            },
        },
    },
    {"type": "function", "function": {"name": "get_time", "description": "The time now", "parameters": {}}},
]
# what a client sends back after the model called the tools: its calls (arguments as JSON text, as
# OpenAI gives them) and their results; Mistral's templates want 9-character ids
ROUND_TRIP = [
    {"role": "system", "content": "You answer briefly."},
    {"role": "user", "content": "What is the weather in Paris and the time?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "abcdefgh1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'},
            },
            {"id": "abcdefgh2", "type": "function", "function": {"name": "get_time", "arguments": ""}},
        ],
    },
    {"role": "tool", "tool_call_id": "abcdefgh1", "content": '{"temperature": 18, "sky": "clear"}'},
    {"role": "tool", "tool_call_id": "abcdefgh2", "content": "12:30"},
]
TOOL_TEMPLATES = sorted(name for name, m in MODELS.items() if m.get("tool_format"))
# Llama 3.1's template takes one call per message, and says so; transformers gets the same error
ONE_CALL = {"llama-3.1-8b-instruct"}


def vllm_dicts(chat: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The messages as vLLM hands them to apply_chat_template: null content is "", and a tool call's
    JSON arguments are parsed to a value (empty ones to {}); the reference our rendering matches."""
    out = []
    for m in chat:
        m = dict(m)
        if m.get("content") is None:
            m["content"] = ""
        if m.get("tool_calls"):
            m["tool_calls"] = [
                {**c, "function": {**c["function"], "arguments": json.loads(c["function"]["arguments"] or "{}")}}
                for c in m["tool_calls"]
            ]
        out.append(m)
    return out


def ours(chat: list[dict[str, Any]]) -> list[ChatMessage]:
    return [ChatMessage.from_openai(m) for m in chat]


def specs(tools: list[dict[str, Any]] | None) -> list[ToolSpec] | None:
    return None if tools is None else [ToolSpec.from_openai(t) for t in tools]


def assert_renders_as_transformers(
    s: Setup, chat: list[dict[str, Any]], tools: list[dict[str, Any]] | None, add: bool = True, **kwargs: Any
) -> str:
    """Our text and token ids for `chat` are transformers' (on vLLM's messages), or both refuse it alike."""
    reference = vllm_dicts(chat)
    try:
        want = s.hf.apply_chat_template(reference, tools=tools, tokenize=False, add_generation_prompt=add, **kwargs)
    except jinja2.TemplateError as exc:
        with pytest.raises(ChatTemplateError) as info:
            s.template.render(ours(chat), add, tools=specs(tools), template_kwargs=kwargs)
        assert str(info.value) == str(exc)
        return ""
    got = s.template.render(ours(chat), add, tools=specs(tools), template_kwargs=kwargs)
    assert got == want
    ids = s.hf.apply_chat_template(
        reference, tools=tools, tokenize=True, add_generation_prompt=add, return_dict=False, **kwargs
    )
    assert s.template.prompt_ids(s.ours, ours(chat), add, tools=specs(tools), template_kwargs=kwargs) == ids
    return got


@pytest.mark.parametrize("name", TOOL_TEMPLATES)
def test_tools_render_as_in_transformers(setups: dict[str, Setup], name: str) -> None:
    s = setups[name]
    text = assert_renders_as_transformers(s, ROUND_TRIP[:2], TOOLS)
    assert "get_weather" in text and "The city's name" in text  # the template did write the tools
    assert_renders_as_transformers(s, ROUND_TRIP[1:2], TOOLS)  # without a system message
    assert_renders_as_transformers(s, ROUND_TRIP[1:2], [])  # tools: [] is passed as [], not as none


@pytest.mark.parametrize("name", TOOL_TEMPLATES)
def test_a_tool_call_round_trip_renders_as_in_transformers(setups: dict[str, Setup], name: str) -> None:
    s = setups[name]
    one_call = [*ROUND_TRIP[:2], {**ROUND_TRIP[2], "tool_calls": ROUND_TRIP[2]["tool_calls"][:1]}, ROUND_TRIP[3]]
    text = assert_renders_as_transformers(s, one_call, TOOLS)
    assert "Paris" in text and "18" in text  # the call and its result
    two = assert_renders_as_transformers(s, ROUND_TRIP, TOOLS)  # two calls at once, two results
    assert (two == "") == (name in ONE_CALL)
    # the conversation goes on after the results: an answer, and a new question
    more = [*one_call, {"role": "assistant", "content": "It is 18 degrees."}, {"role": "user", "content": "Thanks"}]
    assert_renders_as_transformers(s, more, TOOLS)


def test_arguments_are_parsed_as_vllm_does_before_the_template_writes_them(setups: dict[str, Setup]) -> None:
    # Qwen2.5's template writes arguments with tojson: given the JSON text, it would write a quoted
    # string, which is why vLLM (and we) parse it first; Qwen3's writes a string as it is
    s = setups["qwen2.5-7b-instruct"]
    call = ROUND_TRIP[:3]
    as_text = s.hf.apply_chat_template([*call[:2], {**call[2], "content": ""}], tools=TOOLS, tokenize=False)
    assert '"arguments": "{\\"city\\":\\"Paris\\"}"' in as_text
    ours_text = s.template.render(ours(call), False, tools=specs(TOOLS))
    assert '"arguments": {"city": "Paris"}' in ours_text and ours_text != as_text


@pytest.mark.parametrize("enable_thinking", [False, True, None])
def test_qwen3_enable_thinking(setups: dict[str, Setup], enable_thinking: bool | None) -> None:
    s = setups["qwen3-30b-a3b"]
    kwargs = {} if enable_thinking is None else {"enable_thinking": enable_thinking}
    for chat, tools in ((CHATS["multi-turn"], None), (ROUND_TRIP, TOOLS)):
        dicts = as_dicts(chat) if tools is None else chat
        text = assert_renders_as_transformers(s, dicts, tools, **kwargs)
        assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n") == (enable_thinking is False)


def test_qwen3_renders_the_reasoning_of_the_turn_in_progress(setups: dict[str, Setup]) -> None:
    # after the last user message, an assistant's reasoning_content is written back (tool call loops)
    s = setups["qwen3-30b-a3b"]
    chat = [
        ROUND_TRIP[1],
        {**ROUND_TRIP[2], "reasoning_content": "The user wants the weather and the time."},
        *ROUND_TRIP[3:],
    ]
    text = assert_renders_as_transformers(s, chat, TOOLS)
    assert "<think>\nThe user wants the weather and the time.\n</think>" in text


@pytest.mark.parametrize(
    "name",
    [
        "messages",
        "tools",
        "documents",
        "add_generation_prompt",
        "tokenize",
        "chat_template",
        # transformers lets its kwargs override these; a client must not write the model's control text
        # (issue 54), nor shadow the template's globals
        "bos_token",
        "eos_token",
        "raise_exception",
        "strftime_now",
    ],
)
def test_reserved_template_variables_are_refused(name: str) -> None:
    with pytest.raises(ChatTemplateError, match=f"chat_template_kwargs may not set '{name}'"):
        ChatTemplate("x", bos_token="<s>", eos_token="</s>").render(USER, template_kwargs={name: "<s>"})


def test_transformers_refuses_a_messages_kwarg_too(setups: dict[str, Setup]) -> None:
    with pytest.raises(TypeError, match="multiple values for keyword argument 'messages'"):
        setups["qwen3-30b-a3b"].hf.apply_chat_template(as_dicts(CHATS["user"]), tokenize=False, messages=[])


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"x": float("nan")}, "not finite"),
        ({"x": {1: "a"}}, "key that is not a string"),
        ({"x": object()}, "only JSON values"),
        ({"x": [[[[[[[[]]]]]]]] * 2}, None),
        ("enable_thinking", "must be an object"),
    ],
)
def test_template_kwargs_are_json_values(kwargs: Any, words: str | None) -> None:
    if words is None:
        assert check_template_kwargs(kwargs) == kwargs
        return
    with pytest.raises(ChatTemplateError, match=words):
        check_template_kwargs(kwargs)


def test_template_kwargs_nesting_is_bounded() -> None:
    deep: Any = "x"
    for _ in range(100):
        deep = [deep]
    with pytest.raises(ChatTemplateError, match="nested more than 64 levels"):
        check_template_kwargs({"deep": deep})


def test_template_kwargs_reach_the_template_as_plain_values() -> None:
    t = ChatTemplate("{{ a.b[1] }}|{{ flag is false }}|{{ n * 2 }}|{{ tools is none }}")
    assert t.render(USER, template_kwargs={"a": {"b": (1, "two")}, "flag": False, "n": 21}) == "two|True|42|True"


def test_tool_messages_and_calls_are_checked() -> None:
    call = ToolCall("c1", "f", '{"a": 1}')
    assert ChatMessage("assistant", "", tool_calls=(call,)).tool_calls == (call,)
    for kwargs, words in (
        ({"role": "user", "content": "x", "tool_calls": (call,)}, "only an assistant message has tool_calls"),
        ({"role": "assistant", "content": "x", "tool_call_id": "c1"}, "only a tool message has a tool_call_id"),
        ({"role": "user", "content": "x", "reasoning_content": "r"}, "only an assistant message has reasoning"),
        ({"role": "assistant", "content": "x", "tool_calls": [call]}, "must be a tuple of ToolCall"),
    ):
        with pytest.raises(ChatTemplateError, match=words):
            ChatMessage(**kwargs)
    with pytest.raises(ChatTemplateError, match="only function tool calls"):
        ToolCall.from_openai({"id": "x", "type": "custom", "function": {"name": "f"}})
    with pytest.raises(ChatTemplateError, match="arguments of tool call 'c2' \\(f\\) are not JSON"):
        ChatTemplate("{{ messages }}").render([ChatMessage("assistant", "", tool_calls=(ToolCall("c2", "f", "{x"),))])
    with pytest.raises(ChatTemplateError, match="parameters of tool 'f' must be a JSON schema object"):
        ToolSpec("f", parameters="[1]")
    with pytest.raises(ChatTemplateError, match="only function tools"):
        ToolSpec.from_openai({"type": "retrieval"})


def test_openai_messages_become_chat_messages() -> None:
    m = ChatMessage.from_openai(ROUND_TRIP[2])
    assert m.content == "" and [c.name for c in m.tool_calls] == ["get_weather", "get_time"]
    assert m.tool_calls[0].to_openai() == ROUND_TRIP[2]["tool_calls"][0]
    assert m.tool_calls[1].arguments_value() == {}  # empty arguments render as {}, as vLLM's
    assert ChatMessage.from_openai(ROUND_TRIP[3]).tool_call_id == "abcdefgh1"
    given_as_value = {"id": "c", "function": {"name": "f", "arguments": {"é": [1, 2]}}}
    assert ToolCall.from_openai(given_as_value).arguments == '{"é": [1, 2]}'
    assert ChatMessage.from_openai({"role": "assistant", "content": "x", "reasoning": "r"}).reasoning_content == "r"
    spec = ToolSpec.from_openai(TOOLS[0])
    assert spec.to_openai() == TOOLS[0] and ToolSpec("f").to_openai() == {"type": "function", "function": {"name": "f"}}


def test_supports_tools(setups: dict[str, Setup]) -> None:
    assert {n for n, s in setups.items() if s.template.supports_tools} == set(TOOL_TEMPLATES)


def test_a_tool_use_template_is_used_with_tools_as_in_transformers(tmp_path: Path) -> None:
    model = write_demo_model(tmp_path / "demo", "tiny", seed=0, progress=False)
    config = json.loads((model / "tokenizer_config.json").read_text())
    tool_use = "{% for t in tools %}[{{ t.function.name }}]{% endfor %}{{ messages[-1].content }}"
    config["chat_template"] = [
        {"name": "default", "template": "plain:{{ messages[-1].content }}"},
        {"name": "tool_use", "template": tool_use},
    ]
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    hf = AutoTokenizer.from_pretrained(model)
    template = ChatTemplate.from_model_dir(model)
    assert template is not None and template.supports_tools
    chat = as_dicts(CHATS["user"])
    for tools in (None, TOOLS, []):
        want = hf.apply_chat_template(chat, tools=tools, tokenize=False)
        assert template.render(as_messages(CHATS["user"]), False, tools=specs(tools)) == want
    # as files: chat_template.jinja and additional_chat_templates/tool_use.jinja win over the config
    (model / "chat_template.jinja").write_text("file:{{ messages[-1].content }}")
    (model / "additional_chat_templates").mkdir()
    (model / "additional_chat_templates" / "tool_use.jinja").write_text("tools-file:" + tool_use)
    hf = AutoTokenizer.from_pretrained(model)
    template = ChatTemplate.from_model_dir(model)
    assert template is not None
    for tools in (None, TOOLS):
        want = hf.apply_chat_template(chat, tools=tools, tokenize=False)
        assert template.render(as_messages(CHATS["user"]), False, tools=specs(tools)) == want


def test_the_tool_use_template_is_checked_at_load(tmp_path: Path) -> None:
    d = write_config(
        tmp_path, chat_template=[{"name": "default", "template": "a"}, {"name": "tool_use", "template": "{% if %}"}]
    )
    with pytest.raises(ChatTemplateError, match=r"chat_template \(tool_use\): chat template syntax error"):
        ChatTemplate.from_model_dir(d)


def test_tools_are_bounded_as_any_render() -> None:
    t = ChatTemplate("{% for t in tools %}{{ t | tojson }}{% endfor %}")
    tools = [ToolSpec(f"f{i}", "x" * 1000) for i in range(100)]
    with pytest.raises(ChatTemplateError, match="more than 65536 bytes"):
        t.render(USER, tools=tools, max_bytes=65536)
    assert len(t.render(USER, tools=tools[:10], max_bytes=65536)) > 10000


@pytest.mark.parametrize("name", TOOL_TEMPLATES)
def test_the_renderer_processes_render_tools_as_in_process(setups: dict[str, Setup], name: str) -> None:
    from moe_lightning.template_renderer import TemplateRenderer

    s = setups[name]
    r = TemplateRenderer(s.template, max_bytes=1 << 20, processes=1)
    r.start()
    try:
        one_call = [*ROUND_TRIP[:2], {**ROUND_TRIP[2], "tool_calls": ROUND_TRIP[2]["tool_calls"][:1]}, ROUND_TRIP[3]]
        for chat, kwargs in ((one_call, {}), (ROUND_TRIP[:2], {"enable_thinking": False, "x": [1, {"y": None}]})):
            want = s.template.render(ours(chat), tools=specs(TOOLS), template_kwargs=kwargs)
            assert r.render(ours(chat), tools=specs(TOOLS), template_kwargs=kwargs) == want
        with pytest.raises(ChatTemplateError, match="may not set 'messages'"):  # refused before a renderer is used
            r.render(ours(ROUND_TRIP[:2]), template_kwargs={"messages": []})
        with pytest.raises(ChatTemplateError, match="are not JSON"):  # the child's error, for the client
            bad = ChatMessage("assistant", "", tool_calls=(ToolCall("abcdefgh1", "f", "{"),))
            r.render([*ours(ROUND_TRIP[:2]), bad])
    finally:
        r.close()


def test_a_renderer_renders_with_the_tool_use_template() -> None:
    from moe_lightning.template_renderer import TemplateRenderer

    t = ChatTemplate("plain", tool_source="{% for t in tools %}{{ t.function.name }}{% endfor %}")
    r = TemplateRenderer(t, max_bytes=65536, processes=1)
    r.start()
    try:
        assert r.render(USER) == "plain" and r.render(USER, tools=specs(TOOLS)) == "get_weatherget_time"
    finally:
        r.close()
