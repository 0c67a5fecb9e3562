"""Structured outputs (moe_lightning/grammar, docs/structured-outputs.md): outputs generated under the
masks from random logits match their grammar, the masks leave other rows alone, replay restores them.

Random "models": each step draws fresh N(0, 1) logits from a seeded generator, masks them, and picks
the argmax or a multinomial draw. Every grammar here bounds its strings and arrays so such a model
ends well within CAP tokens; a run that reaches CAP fails the test."""

from __future__ import annotations

import json
import random
import re
import subprocess
import sys

import jsonschema
import pytest
import torch
from tokenizers import Tokenizer, decoders, models, normalizers, trainers

from moe_lightning.demo_model import build_tokenizer
from moe_lightning.grammar import (
    GrammarCompiler,
    GrammarError,
    GrammarKind,
    GrammarSpec,
    GrammarState,
    GrammarStateError,
    GrammarVocabulary,
    accept_tokens,
    apply_grammar_masks,
    check_grammar,
    fill_bitmask,
)
from moe_lightning.tokenizer import TextTokenizer

CAP = 600  # tokens per generation; the longest outputs below take ~200 with the 512-token vocabulary
TOKENIZER_SIZE = 512  # the tiny preset's vocab_size (moe_lightning/demo_model.py)
MODEL_VOCAB = 520  # logits wider than the tokenizer, as a padded embedding table makes them
EOS = 2
SEEDS = (0, 1, 2)
MODES = ("argmax", "multinomial")

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 130},
        "role": {"enum": ["admin", "user", "guest"]},
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 8},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},  # anchored: JSON Schema's pattern is a search
            },
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 5}, "maxItems": 3},
    },
    "required": ["name", "age", "role", "address", "tags"],
    "additionalProperties": False,
}
SCHEMAS = {
    "enum": {"enum": ["red", "green", "blue", 7, None]},
    "bounded_integer": {"type": "integer", "minimum": -20, "maximum": 300},
    "string_max_length": {"type": "string", "maxLength": 6},
    "array_max_items": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "maxItems": 4},
    "required_closed": {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 1, "maximum": 5}},
        "required": ["ok", "n"],
        "additionalProperties": False,
    },
    # optional keys may be left out: additionalProperties false still forbids any other
    "optional_closed": {
        "type": "object",
        "properties": {"a": {"type": "boolean"}, "b": {"type": "null"}},
        "additionalProperties": False,
    },
    "nested_person": PERSON,
}
WEATHER_CALL = {
    "anyOf": [
        {
            "type": "object",
            "properties": {
                "name": {"const": "get_weather"},
                "arguments": {
                    "type": "object",
                    "properties": {
                        "city": {"type": "string", "maxLength": 8},
                        "unit": {"enum": ["celsius", "fahrenheit"]},
                    },
                    "required": ["city", "unit"],
                    "additionalProperties": False,
                },
            },
            "required": ["name", "arguments"],
            "additionalProperties": False,
        },
        {
            "type": "object",
            "properties": {
                "name": {"const": "add"},
                "arguments": {
                    "type": "object",
                    "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99}},
                    "required": ["a"],
                    "additionalProperties": False,
                },
            },
            "required": ["name", "arguments"],
            "additionalProperties": False,
        },
    ]
}


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return build_tokenizer(TOKENIZER_SIZE)


@pytest.fixture(scope="module")
def compiler(tokenizer: Tokenizer) -> GrammarCompiler:
    return GrammarCompiler(GrammarVocabulary(TextTokenizer(tokenizer), MODEL_VOCAB, [EOS]))


def generate(compiler: GrammarCompiler, spec: GrammarSpec, seed: int, mode: str) -> tuple[list[int], GrammarState]:
    """Tokens until the grammar terminates (stop token excluded) and the final state."""
    state = compiler.compile(spec).new_state()
    gen = torch.Generator().manual_seed(seed)
    tokens: list[int] = []
    while not state.is_terminated:
        assert len(tokens) < CAP, f"no end within {CAP} tokens: {compiler.vocabulary.token_bytes(tokens)!r}"
        logits = torch.randn((1, compiler.vocabulary.vocab_size), generator=gen)
        apply_grammar_masks(logits, [state])
        if mode == "argmax":
            token = int(logits[0].argmax())
        else:
            token = int(torch.multinomial(torch.softmax(logits[0], dim=-1), 1, generator=gen))
        state.accept(token)
        tokens.append(token)
    assert tokens[-1] in compiler.vocabulary.stop_token_ids
    return tokens[:-1], state


def text_of(tokenizer: Tokenizer, tokens: list[int]) -> str:
    return TextTokenizer(tokenizer).decode(tokens)


def allowed(compiler: GrammarCompiler, state: GrammarState) -> set[int]:
    logits = torch.zeros((1, compiler.vocabulary.vocab_size))
    apply_grammar_masks(logits, [state])
    return set(torch.isfinite(logits[0]).nonzero().view(-1).tolist())


# ---- the spec ------------------------------------------------------------------------------------------
def test_spec_checks_shape_without_the_library() -> None:
    assert GrammarSpec("json_schema", '{"type": "object"}').kind is GrammarKind.JSON_SCHEMA
    bad = {
        ("nope", ""): "unknown grammar kind 'nope'",
        ("json_object", "{}"): "must be empty",
        ("json_schema", "{not json"): "not valid JSON",
        ("json_schema", "[1]"): "must be a JSON object",
        ("regex", ""): "regex is empty",
        ("choice", "[]"): "non-empty JSON list of strings",
        ("choice", '["a", 1]'): "non-empty JSON list of strings",
        ("tool_calls", '{"begin": "", "separator": "", "end": ""}'): "exactly the keys",
        ("tool_calls", '{"begin": 1, "separator": "", "end": "", "schema": {}}'): "'begin' must be a string",
        ("json_schema", "{" + " " * (200 * 1024) + "}"): "more than the",
    }
    for (kind, source), message in bad.items():
        with pytest.raises(GrammarError, match=re.escape(message)):
            GrammarSpec(kind, source)
    spec = GrammarSpec.tool_calls(WEATHER_CALL, begin="<tool_call>", separator="\n", end="</tool_call>")
    assert GrammarSpec.from_json(spec.to_json()) == spec
    assert GrammarSpec(spec.kind.value, spec.source) == spec  # the wire's two strings
    assert hash(GrammarSpec.choice(["a", "b"])) == hash(GrammarSpec(GrammarKind.CHOICE, '["a","b"]'))
    with pytest.raises(GrammarError):
        GrammarSpec.from_json('{"kind": "regex"}')


def test_importing_costs_neither_torch_nor_the_library() -> None:
    code = "import sys, moe_lightning.grammar; print('torch' in sys.modules, 'llguidance' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]


# ---- outputs match their grammar ----------------------------------------------------------------------
@pytest.mark.parametrize("mode", MODES)
def test_json_object_outputs_are_objects(compiler: GrammarCompiler, tokenizer: Tokenizer, mode: str) -> None:
    """Any object has no bound on its size: a random model may go on past any budget (a real request
    then ends at max_tokens, cut). Every output that ends is an object, and most do."""
    ended = 0
    for seed in SEEDS:
        try:
            tokens, _ = generate(compiler, GrammarSpec.json_object(), seed, mode)
        except AssertionError as exc:
            assert "no end within" in str(exc)
            continue
        assert isinstance(json.loads(text_of(tokenizer, tokens)), dict)
        ended += 1
    assert ended >= len(SEEDS) // 2


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", list(SCHEMAS))
def test_json_schema_outputs_validate(compiler: GrammarCompiler, tokenizer: Tokenizer, name: str, mode: str) -> None:
    schema = SCHEMAS[name]
    outputs = set()
    for seed in SEEDS:
        tokens, _ = generate(compiler, GrammarSpec.json_schema(schema), seed, mode)
        text = text_of(tokenizer, tokens)
        jsonschema.validate(json.loads(text), schema)
        outputs.add(text)
    assert len(outputs) > 1 or name == "enum"  # the random model does explore


@pytest.mark.parametrize("mode", MODES)
def test_regex_outputs_fullmatch(compiler: GrammarCompiler, tokenizer: Tokenizer, mode: str) -> None:
    for pattern in (r"[a-z][a-z0-9._]{0,12}@[a-z]{1,8}\.(com|org)", r"(yes|no)", r"-?[0-9]{1,4}(\.[0-9]{1,2})?"):
        for seed in SEEDS:
            tokens, _ = generate(compiler, GrammarSpec.regex(pattern), seed, mode)
            assert re.fullmatch(pattern, text_of(tokenizer, tokens))


@pytest.mark.parametrize("mode", MODES)
def test_choice_outputs_are_one_of_the_choices(compiler: GrammarCompiler, tokenizer: Tokenizer, mode: str) -> None:
    # prefixes of one another and characters that are syntax elsewhere
    choices = ["pos", "positive", 'say "hi"', "a|b", "naïve", ""]
    seen = set()
    for seed in range(8):
        tokens, _ = generate(compiler, GrammarSpec.choice(choices), seed, mode)
        seen.add(text_of(tokenizer, tokens))
    assert seen <= set(choices) and len(seen) > 1


def parse_tool_calls(text: str, begin: str, separator: str, end: str) -> list[object]:
    """begin call (separator call)* end, each call one JSON value: a strict reading of the output."""
    assert text.startswith(begin) and text.endswith(end), text
    decoder = json.JSONDecoder()
    calls, pos, body_end = [], len(begin), len(text) - len(end)
    while True:
        while pos < body_end and text[pos] in " \t\n\r":  # JSON's whitespace before a value (raw_decode takes none)
            pos += 1
        if pos == body_end and calls:  # bare calls back to back: the last one's trailing whitespace
            return calls
        call, pos = decoder.raw_decode(text, pos)
        calls.append(call)
        # whitespace after a value, up to where the separator or the end begins (which may start with some)
        while pos < body_end and not text.startswith(separator, pos) and text[pos] in " \t\n\r":
            pos += 1
        if pos == body_end:
            return calls
        assert text.startswith(separator, pos), text
        pos += len(separator)


@pytest.mark.parametrize("mode", MODES)
def test_tool_calls_output_parses(compiler: GrammarCompiler, tokenizer: Tokenizer, mode: str) -> None:
    forms = [
        ("<tool_call>\n", "\n</tool_call>\n<tool_call>\n", "\n</tool_call>"),  # Qwen / Hermes
        ("[", ", ", "]"),  # a JSON list of calls
        ("", "", ""),  # bare calls back to back
    ]
    counts = set()
    for begin, separator, end in forms:
        spec = GrammarSpec.tool_calls(WEATHER_CALL, begin=begin, separator=separator, end=end)
        for seed in SEEDS:
            tokens, _ = generate(compiler, spec, seed, mode)
            calls = parse_tool_calls(text_of(tokenizer, tokens), begin, separator, end)
            for call in calls:
                jsonschema.validate(call, WEATHER_CALL)
            counts.add(len(calls))
    assert max(counts) > 1  # separators were used


# ---- errors --------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (GrammarSpec.json_schema({"type": "array", "uniqueItems": True}), "uniqueItems"),
        (GrammarSpec.json_schema({"type": "object", "not": {}}), '["not"]'),
        (GrammarSpec.json_schema({"type": "strnig"}), "strnig"),
        (
            GrammarSpec.json_schema({"type": "integer", "minimum": 9, "maximum": 2}),
            "minimum (9) is greater than maximum",
        ),
        (GrammarSpec.json_schema({"type": "integer", "minimum": "x"}), "minimum"),
        (GrammarSpec.json_schema({"$ref": "#/$defs/missing"}), "/$defs/missing"),
        (GrammarSpec.json_schema({"type": "string", "format": "bogus"}), "bogus"),
        (GrammarSpec.regex("a(?=b)"), "look-around"),
        (GrammarSpec.regex("(ab"), "unclosed group"),
        (GrammarSpec.tool_calls({"type": "object", "uniqueItems": True}), "uniqueItems"),
    ],
)
def test_bad_grammars_raise_a_grammar_error_naming_the_problem(
    compiler: GrammarCompiler, spec: GrammarSpec, message: str
) -> None:
    with pytest.raises(GrammarError, match=re.escape(message)) as info:
        compiler.check(spec)
    assert str(info.value).startswith(f"{spec.kind} grammar: ") and len(str(info.value)) < 1100
    with pytest.raises(GrammarError, match=re.escape(message)):
        check_grammar(spec)  # the same answer without a vocabulary


def test_a_disallowed_token_raises(compiler: GrammarCompiler, tokenizer: Tokenizer) -> None:
    state = compiler.compile(GrammarSpec.choice(["yes", "no"])).new_state()
    with pytest.raises(GrammarStateError, match="rejected token"):
        state.accept(tokenizer.token_to_id("z"))
    state = compiler.compile(GrammarSpec.choice(["yes", "no"])).new_state()
    state.replay(tokenizer.encode("no", add_special_tokens=False).ids)
    state.accept(EOS)
    assert state.is_terminated
    with pytest.raises(GrammarStateError, match="after the grammar terminated"):
        state.accept(EOS)


# ---- the mask ------------------------------------------------------------------------------------------
def test_only_stop_tokens_once_complete_and_none_before(tokenizer: Tokenizer) -> None:
    stops = [EOS, 1]
    compiler = GrammarCompiler(GrammarVocabulary(tokenizer, MODEL_VOCAB, stops))
    state = compiler.compile(GrammarSpec.choice(["positive", "negative"])).new_state()
    assert not allowed(compiler, state) & set(stops)
    state.replay(tokenizer.encode("positive", add_special_tokens=False).ids)
    assert state.is_accepting and not state.is_terminated
    assert allowed(compiler, state) == set(stops)
    state.accept(1)  # any of the stop ids ends it
    assert state.is_terminated


def test_ids_past_the_tokenizer_are_always_masked(compiler: GrammarCompiler) -> None:
    specs = [GrammarSpec.json_object(), GrammarSpec.regex(r"[\s\S]{0,40}"), GrammarSpec.choice(["a", "b"])]
    states = [compiler.compile(s).new_state() for s in specs]
    logits = torch.zeros((len(states), MODEL_VOCAB))
    apply_grammar_masks(logits, states)
    assert torch.isneginf(logits[:, TOKENIZER_SIZE:]).all()
    # an anything-goes regex allows nearly the whole tokenizer, still none of the extra ids
    assert torch.isfinite(logits[1, :TOKENIZER_SIZE]).sum() > TOKENIZER_SIZE // 2


def test_rows_without_a_grammar_are_bit_identical(compiler: GrammarCompiler) -> None:
    gen = torch.Generator().manual_seed(0)
    a = compiler.compile(GrammarSpec.json_schema(PERSON)).new_state()
    b = compiler.compile(GrammarSpec.regex("[0-9]{3}")).new_state()
    states = [None, a, None, None, b, None]
    logits = torch.randn((len(states), MODEL_VOCAB), generator=gen)
    logits[0, 5] = float("nan")  # untouched means untouched, NaN payloads included
    logits[3, 7] = float("-inf")
    before = logits.clone()
    apply_grammar_masks(logits, states)
    for row in (0, 2, 3, 5):
        assert torch.equal(logits[row].view(torch.int32), before[row].view(torch.int32))
    for row, state in ((1, a), (4, b)):  # masked rows equal that row masked alone
        alone = before[row : row + 1].clone()
        apply_grammar_masks(alone, [state])
        assert torch.equal(logits[row], alone[0])
    snapshot = logits.clone()
    apply_grammar_masks(logits, [None] * len(states))  # no grammar rows: a no-op
    assert torch.equal(logits.view(torch.int32), snapshot.view(torch.int32))


def test_replay_after_recreation_gives_the_same_mask(compiler: GrammarCompiler) -> None:
    compiled = compiler.compile(GrammarSpec.json_schema(PERSON))
    tokens, _ = generate(compiler, compiled.spec, seed=3, mode="multinomial")
    for cut in (0, 1, len(tokens) // 3, len(tokens) - 1):
        live = compiled.new_state()
        for t in tokens[:cut]:
            live.accept(t)
        again = compiled.new_state(replay=tokens[:cut])  # a preempted sequence, re-prefilled
        masks = torch.zeros((2, compiler.vocabulary.bitmask_words), dtype=torch.int32)
        fill_bitmask([live, again], masks)
        assert torch.equal(masks[0], masks[1]) and again.num_tokens == cut


def test_batched_accept_matches_one_by_one(compiler: GrammarCompiler) -> None:
    specs = [GrammarSpec.json_schema(PERSON), GrammarSpec.regex("[a-z]{2,9}"), GrammarSpec.json_object()]
    runs = [[*generate(compiler, s, seed=i, mode="multinomial")[0], EOS] for i, s in enumerate(specs)]
    batched = [compiler.compile(s).new_state() for s in specs]
    single = [compiler.compile(s).new_state() for s in specs]
    for step in range(max(map(len, runs))):
        live = [step < len(run) for run in runs]
        # a finished row and a row that never had a grammar pass None; their tokens are ignored
        states = [b if alive else None for b, alive in zip(batched, live, strict=True)] + [None]
        tokens = [run[step] if alive else 0 for run, alive in zip(runs, live, strict=True)] + [12345]
        accept_tokens(states, tokens)
        for state, run, alive in zip(single, runs, live, strict=True):
            if alive:
                state.accept(run[step])
        masks = torch.zeros((6, compiler.vocabulary.bitmask_words), dtype=torch.int32)
        fill_bitmask(batched + single, masks)
        assert torch.equal(masks[:3], masks[3:])
    assert all(s.is_terminated for s in batched + single)
    with pytest.raises(GrammarStateError):
        accept_tokens([compiler.compile(specs[1]).new_state()], [EOS])  # "" does not match [a-z]{2,9}


def test_compiler_caches_by_spec_lru(tokenizer: Tokenizer) -> None:
    compiler = GrammarCompiler(GrammarVocabulary(tokenizer, TOKENIZER_SIZE, [EOS]), cache_size=2)
    a, b, c = (GrammarSpec.choice([x]) for x in "abc")
    first = compiler.compile(a)
    assert compiler.compile(GrammarSpec(GrammarKind.CHOICE, '["a"]')) is first
    compiler.compile(b)
    compiler.compile(a)  # a is now the most recent: c evicts b
    compiler.compile(c)
    assert len(compiler) == 2 and compiler.compile(a) is first
    assert compiler.hits == 3 and compiler.misses == 3


def test_vocabulary_checks_its_sizes(tokenizer: Tokenizer) -> None:
    with pytest.raises(ValueError, match="512 tokens but the model's vocabulary has 500"):
        GrammarVocabulary(tokenizer, 500, [EOS])
    with pytest.raises(ValueError, match="at least one stop token"):
        GrammarVocabulary(tokenizer, 512, [])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        GrammarVocabulary(tokenizer, 512, [512])
    compiler = GrammarCompiler(GrammarVocabulary(tokenizer, 512, [EOS]))
    with pytest.raises(ValueError, match="columns"):
        apply_grammar_masks(torch.zeros((1, 520)), [compiler.compile(GrammarSpec.json_object()).new_state()])


# ---- other vocabularies --------------------------------------------------------------------------------
def sentencepiece_tokenizer() -> Tokenizer:
    """Mixtral's layout: <unk> <s> </s>, the 256 byte tokens <0x00>..<0xFF>, then pieces with ▁ for a
    space; text is normalized with a leading ▁ and decoded with byte fallback."""
    rng = random.Random(0)
    words = ["".join(rng.choice("abcdefghijklmnoprstuvwz") for _ in range(rng.randint(1, 6))) for _ in range(300)]
    lines = [" ".join(rng.choices(words, k=12)) for _ in range(3000)]
    normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    base = Tokenizer(models.BPE(unk_token="<unk>"))
    base.normalizer = normalizer
    base.train_from_iterator(
        lines, trainer=trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False)
    )
    trained = json.loads(base.to_str())["model"]
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2} | {f"<0x{b:02X}>": 3 + b for b in range(256)}
    for piece in sorted(trained["vocab"], key=trained["vocab"].get):
        vocab.setdefault(piece, len(vocab))
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in trained["merges"]]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.normalizer = normalizer
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    return tok


def test_sentencepiece_byte_fallback_vocabulary() -> None:
    tok = sentencepiece_tokenizer()
    assert tok.encode("{").tokens == ["▁", "<0x7B>"]  # byte fallback in use
    compiler = GrammarCompiler(GrammarVocabulary(tok, tok.get_vocab_size(), [EOS]))
    first = allowed(compiler, compiler.compile(GrammarSpec.json_object()).new_state())
    assert tok.token_to_id("<0x7B>") in first  # "{" through its byte token
    assert tok.token_to_id("▁") not in first  # a leading space is no JSON
    for seed in SEEDS:
        tokens, _ = generate(compiler, GrammarSpec.json_schema(SCHEMAS["required_closed"]), seed, "multinomial")
        jsonschema.validate(json.loads(tok.decode(tokens)), SCHEMAS["required_closed"])
        tokens, _ = generate(compiler, GrammarSpec.regex(r"[a-z]{1,6} [a-z]{1,6}\n"), seed, "multinomial")
        assert re.fullmatch(r"[a-z]{1,6} [a-z]{1,6}\n", compiler.vocabulary.token_bytes(tokens).decode())


def test_bench_preset_vocabulary() -> None:
    """The 32,000-token demo tokenizer (the bench and mixtral-8x7b-4l presets)."""
    tok = build_tokenizer(32000)
    compiler = GrammarCompiler(GrammarVocabulary(tok, 32000, [EOS]))
    for mode in MODES:
        tokens, _ = generate(compiler, GrammarSpec.json_schema(PERSON), 0, mode)
        jsonschema.validate(json.loads(text_of(tok, tokens)), PERSON)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_logits_are_masked_like_host_logits(compiler: GrammarCompiler) -> None:
    states = [compiler.compile(GrammarSpec.json_schema(PERSON)).new_state(), None]
    states.append(compiler.compile(GrammarSpec.choice(["x", "y"])).new_state())
    host = torch.randn((3, MODEL_VOCAB), generator=torch.Generator().manual_seed(0))
    for dtype in (torch.float32, torch.bfloat16):
        device = host.to("cuda", dtype)
        expected = host.to(dtype, copy=True)
        apply_grammar_masks(device, states)
        apply_grammar_masks(expected, states)
        assert torch.equal(device.cpu(), expected)
    full = host.cuda()
    apply_grammar_masks(full, [states[0], states[0], states[2]])  # every row: the whole-batch path
    assert torch.isneginf(full[:, TOKENIZER_SIZE:]).all()
