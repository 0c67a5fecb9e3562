"""A fault belongs to its sequence (issue 54, H1) through a real stack: a structured request whose grammar
fails in the middle of its output (llguidance's lexer limit, reached only once its string begins: no
check at admission sees it) ends alone with a 400-class INVALID_ARGUMENT naming its
grammar, while 16 requests batched with it finish with exactly the tokens they get alone and the
backend is not reset. It used to abort the step: 17 of 17 ended INTERNAL with the grammar's error."""

from __future__ import annotations

import json
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
from tokenizers import Tokenizer

from moe_lightning.client import GenerationClient, Prompt
from moe_lightning.grammar.limits import MAX_PROBED_PATTERNS
from moe_lightning.launcher import Stack
from moe_lightning.service.names import GENERATION as API
from moe_lightning.service.upstream import health_status, open_channel

# compiles at once (llguidance builds its lexer lazily), and its first masks are those of '{"a":"'. The
# server probes a schema's first MAX_PROBED_PATTERNS patterns alone at admission (grammar/limits.py): the
# 32 unused definitions ahead of it take those places, so the heavy one is first met in generation
LATE_FAILING = {
    "$defs": {f"d{i}": {"type": "string", "pattern": f"^x{i}$"} for i in range(MAX_PROBED_PATTERNS)},
    "type": "object",
    "properties": {"a": {"type": "string", "pattern": "^(a{1000}){1000}$"}},
    "required": ["a"],
}


@pytest.fixture(scope="module")
def stack(make_module_stack: Callable[..., Stack], tiny_model: Path) -> Stack:
    return make_module_stack(model=tiny_model, max_batch_size=64, kv_cache_memory="64MiB")


def test_a_grammar_failing_mid_output_ends_alone_beside_16_requests(stack: Stack, tiny_model: Path) -> None:
    plain = [Prompt(text=f"Story {i}:", max_new_tokens=24, ignore_eos=True) for i in range(16)]
    # no whitespace between its JSON tokens: it reaches the pattern within a few steps, the others running
    tokenizer = Tokenizer.from_file(str(tiny_model / "tokenizer.json"))
    spaces = [
        t for t in range(tokenizer.get_vocab_size()) if tokenizer.decode([t]) and not tokenizer.decode([t]).strip()
    ]
    attacker = Prompt(
        text="JSON:",
        max_new_tokens=200,
        grammar=("json_schema", json.dumps(LATE_FAILING)),
        logit_bias=dict.fromkeys(spaces, -100.0),
    )
    with GenerationClient(stack.api_address, timeout=120) as c:
        alone = [out.token_ids for out in c.batch_generate(plain)]
        with ThreadPoolExecutor(len(plain) + 1) as pool:
            failing = pool.submit(c.generate, attacker)
            beside = [pool.submit(c.generate, p) for p in plain]
            results = [f.result() for f in beside]  # none raises (all 17 used to end INTERNAL)
            with pytest.raises(grpc.RpcError) as info:
                failing.result()
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "the request's grammar failed after 6 output tokens" in info.value.details()  # '{"a":"' and an 'a'

        # the library's own words: its lexer outgrew the states the server allows a grammar
        assert "lexer error" in info.value.details() and "states" in info.value.details()
        assert "non-verbose" not in info.value.details()
        assert [r.token_ids for r in results] == alone
        channel = open_channel(stack.api_address)
        try:
            assert health_status(channel, API, timeout=5) == 1  # SERVING: nothing was reset
        finally:
            channel.close()
        assert c.generate(plain[0]).token_ids == alone[0]
