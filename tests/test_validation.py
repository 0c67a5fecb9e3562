"""moe_lightning.validation: every refusal's message and status code, in the order they are checked."""

from __future__ import annotations

import grpc
import pytest

from moe_lightning.demo_model import build_tokenizer
from moe_lightning.kv_layout import KVLayout
from moe_lightning.request import GenerationRequest, InvalidRequestError
from moe_lightning.service.errors import ResourceExhaustedError, status_for
from moe_lightning.spec import ModelSpec
from moe_lightning.tokenizer import TextTokenizer
from moe_lightning.validation import RequestLimits, blocks_needed, prompt_ids, sampling_params, validate

SERVER = RequestLimits(
    vocab_size=320, max_context=1024, has_tokenizer=False, max_prompt_tokens=40, kv_blocks=8, kv_layout=KVLayout(16)
)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"prompt_ids": []}, "prompt is empty: give at least one token"),
        ({"prompt_ids": [1, 320, -1]}, "prompt token ids [320, -1] are outside the vocabulary; allowed: 0..319"),
        ({"prompt_ids": [1], "max_new_tokens": 0}, "max_new_tokens must be >= 1, got 0"),
        (
            {"prompt_ids": [1, 2], "max_new_tokens": 1023},
            "prompt (2 tokens) + max_new_tokens (1023) = 1025 exceeds the model's context of 1024 tokens",
        ),
        ({"prompt_ids": [1], "stop": ("",)}, "stop takes at most 16 non-empty strings"),
        ({"prompt_ids": [1], "stop": ("a",) * 17}, "stop takes at most 16 non-empty strings"),
        ({"prompt_ids": [1], "stop": ("0",)}, "stop strings need the model's tokenizer.json to decode the output"),
        (
            {"prompt_ids": list(range(1, 60))},
            "prompt has 59 tokens; this server accepts at most 40 (--max-prefill-tokens)",
        ),
    ],
)
def test_invalid_requests_say_what_is_allowed(kwargs: dict, message: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        validate(GenerationRequest(**kwargs), SERVER)
    assert str(info.value).startswith(message)
    assert status_for(info.value) == grpc.StatusCode.INVALID_ARGUMENT


def test_more_than_the_whole_kv_cache_is_resource_exhausted() -> None:
    fits = GenerationRequest([1] * 8, max_new_tokens=120)  # 128 tokens: 8 blocks of 16
    validate(fits, SERVER)
    assert blocks_needed(fits, KVLayout(16)) == 8
    with pytest.raises(ResourceExhaustedError) as info:
        validate(GenerationRequest([1] * 8, max_new_tokens=121), SERVER)
    assert (
        str(info.value) == "prompt + max_new_tokens is 129 tokens, 9 KV blocks of 16 tokens; "
        "the cache holds 128 tokens (8 blocks) in all"
    )
    assert status_for(info.value) == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_the_model_alone_sets_no_server_limits() -> None:
    spec = ModelSpec("MixtralForCausalLM", 8, 16, 1, 2, 1, 4, 2, 1, 320, max_position_embeddings=1024)
    assert RequestLimits.of(spec) == RequestLimits(320, 1024)
    # as the in-process engine with a tokenizer sees it: any prompt length, no KV cache of its own
    request = GenerationRequest(list(range(1, 300)), max_new_tokens=700, stop=("x",))
    validate(request, RequestLimits.of(spec))
    with pytest.raises(InvalidRequestError, match="outside the vocabulary"):
        validate(GenerationRequest([320]), RequestLimits.of(spec))


def test_prompt_sources() -> None:
    tok = TextTokenizer(build_tokenizer(400, seed=1))
    assert prompt_ids("Kabeno", None, tok) == tok.encode("Kabeno")
    assert prompt_ids(None, [3, 4], None) == [3, 4]
    for text, ids, tokenizer, message in [
        ("hello", None, None, "this model has no tokenizer: send token_ids instead of text"),
        ("", None, tok, "prompt is empty: give text or at least one token id"),
        (None, None, tok, "prompt is missing: set text or token_ids"),
    ]:
        with pytest.raises(InvalidRequestError, match=message):
            prompt_ids(text, ids, tokenizer)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((-0.1, 0, 1.0, None, 0), "temperature must be a finite number >= 0 (0 = greedy), got -0.1"),
        ((float("inf"), 0, 1.0, None, 0), "temperature must be a finite number >= 0 (0 = greedy), got inf"),
        ((1.0, -1, 0.0, None, 0), "top_p must be in (0, 1], got 0.0"),  # top_p is checked before top_k
        ((1.0, -1, 1.0, None, 0), "top_k must be >= 0 (0 = disabled), got -1"),
        ((1.0, 0, 1.0, None, 21), "logprobs must be in 0..20, got 21"),
    ],
)
def test_sampling_parameters_are_the_clients_error(args: tuple, message: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        sampling_params(*args)
    assert str(info.value) == message


def test_sampling_parameters_pass_through() -> None:
    p = sampling_params(0.7, 5, 0.9, 11, 3)
    assert (p.temperature, p.top_k, p.top_p, p.seed, p.logprobs) == (0.7, 5, 0.9, 11, 3)


def test_every_domain_error_has_its_status() -> None:
    """The map names the classes (their modules import torch); each name is a real exception class,
    and an instance of it, or of a subclass, gets its code."""
    import importlib

    from moe_lightning.service.errors import DOMAIN_CODES

    for module, name, code in DOMAIN_CODES:
        kind = getattr(importlib.import_module(module), name)
        assert issubclass(kind, Exception), (module, name)
        sub = type("Sub", (kind,), {})
        assert status_for(kind("x")) == code and status_for(sub("x")) == code, (module, name)
    assert status_for(ValueError("x")) == grpc.StatusCode.INTERNAL  # a bug, not a domain error


def test_a_refusal_over_layer_groups_counts_tokens() -> None:
    """GPT-OSS-20B's layout: a block holds one group's layers, so blocks alone would mislead."""
    from moe_lightning.hrm.archs import ARCHS

    layout = KVLayout.of(ARCHS["gpt-oss-20b"], 16)
    assert layout.num_groups == 2 and layout.windows[0] is None  # the whole-context group first
    server = RequestLimits(
        vocab_size=320, max_context=4096, has_tokenizer=False, max_prompt_tokens=4096, kv_blocks=20, kv_layout=layout
    )
    with pytest.raises(ResourceExhaustedError) as info:
        validate(GenerationRequest([1] * 200, max_new_tokens=8), server)
    assert str(info.value) == (
        "prompt + max_new_tokens is 208 tokens, 26 KV blocks of 16 tokens in 2 layer groups; "
        "the cache holds 160 tokens (20 blocks) in all"
    )
