"""Chat templates: our rendering against transformers' `apply_chat_template`, on the real templates
of the models we serve (tests/data/chat_templates, sources in its models.json)."""

from __future__ import annotations

import json
from pathlib import Path

import jinja2
import pytest
from tokenizers import Tokenizer
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from moe_lightning.chat_template import ChatMessage, ChatTemplate, ChatTemplateError, content_text
from moe_lightning.demo_model import build_tokenizer, write_demo_model
from moe_lightning.tokenizer import TextTokenizer

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
        tok.add_special_tokens([t for t in (self.bos, self.eos, *MARKERS) if t])
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


@pytest.mark.parametrize("role", ["tool", "developer", "User", ""])
def test_bad_role(role: str) -> None:
    with pytest.raises(ChatTemplateError, match="roles allowed are system, user, assistant"):
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
