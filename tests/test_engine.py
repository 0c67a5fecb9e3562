"""Generation control: EOS, stop strings, token budgets, KV freeing, request validation."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from moe_lightning.checkpoint import load_model_weights
from moe_lightning.engine import InProcessEngine
from moe_lightning.request import GenerationRequest, InvalidRequestError
from moe_lightning.sampling import SamplingParams
from moe_lightning.spec import ModelSpec
from moe_lightning.tokenizer import TextTokenizer


@pytest.fixture(scope="module")
def engine(tiny_model: Path) -> InProcessEngine:
    spec = ModelSpec.from_pretrained(tiny_model)
    return InProcessEngine(
        spec, load_model_weights(tiny_model, spec, progress=False), TextTokenizer.from_model_dir(tiny_model)
    )


def test_stops_at_eos_unless_ignored(engine: InProcessEngine) -> None:
    prompt = [1, 10, 20, 30]
    [free], _ = engine.generate([GenerationRequest(prompt, max_new_tokens=24, ignore_eos=True)])
    # Make the 5th generated token the model's EOS, then check that generation stops there.
    eos = free.token_ids[4]
    spec = engine.spec
    engine.spec = ModelSpec(**{**spec.to_dict(), "eos_token_ids": (eos,)})
    try:
        [stopped], _ = engine.generate([GenerationRequest(prompt, max_new_tokens=24)])
        [ignored], _ = engine.generate([GenerationRequest(prompt, max_new_tokens=24, ignore_eos=True)])
    finally:
        engine.spec = spec
    first = free.token_ids.index(eos)
    assert stopped.finish_reason == "eos" and stopped.token_ids == free.token_ids[: first + 1]
    assert ignored.finish_reason == "length" and ignored.token_ids == free.token_ids


def test_stop_string_truncates_text(engine: InProcessEngine) -> None:
    assert engine.tokenizer is not None
    prompt = engine.tokenizer.encode("Kabeno tisar")
    [full], _ = engine.generate([GenerationRequest(prompt, max_new_tokens=20, ignore_eos=True)])
    assert full.finish_reason == "length" and len(full.token_ids) == 20
    text = full.text or ""
    stop = text[5:8]
    [cut], _ = engine.generate([GenerationRequest(prompt, max_new_tokens=20, ignore_eos=True, stop=(stop,))])
    assert cut.finish_reason == "stop"
    assert cut.text == text[: text.find(stop)]
    assert cut.token_ids == full.token_ids[: len(cut.token_ids)] and len(cut.token_ids) < 20


def test_batch_results_do_not_depend_on_batch_mates(engine: InProcessEngine) -> None:
    prompts = [[1, 5], [1, 9, 9, 9, 9, 9, 9], [1, 100, 3]]
    batch, stats = engine.generate(
        [GenerationRequest(p, max_new_tokens=6 + 3 * i, ignore_eos=True) for i, p in enumerate(prompts)]
    )
    for i, p in enumerate(prompts):
        [alone], _ = engine.generate([GenerationRequest(p, max_new_tokens=6 + 3 * i, ignore_eos=True)])
        assert alone.token_ids == batch[i].token_ids
    assert stats.generated_tokens == 6 + 9 + 12 and stats.decode_steps == 11


def test_seeded_sampling_reproducible_through_engine(engine: InProcessEngine) -> None:
    req = GenerationRequest(
        [1, 4, 5], max_new_tokens=10, ignore_eos=True, sampling=SamplingParams(temperature=1.0, top_p=0.9, seed=7)
    )
    [a], _ = engine.generate([req])
    [b], _ = engine.generate([req])
    assert a.token_ids == b.token_ids


@pytest.mark.parametrize(
    ("request_kwargs", "message"),
    [
        ({"prompt_ids": []}, "prompt is empty"),
        ({"prompt_ids": [1, 512]}, r"outside the vocabulary; allowed: 0..511"),
        ({"prompt_ids": [1], "max_new_tokens": 0}, "max_new_tokens must be >= 1"),
        ({"prompt_ids": [1, 2], "max_new_tokens": 1023}, "exceeds the model's context of 1024 tokens"),
        ({"prompt_ids": [1], "stop": ("",)}, "non-empty strings"),
    ],
)
def test_invalid_requests(engine: InProcessEngine, request_kwargs: dict, message: str) -> None:
    with pytest.raises(InvalidRequestError, match=message):
        engine.generate([GenerationRequest(**request_kwargs)])


def test_kv_blocks_all_returned(engine: InProcessEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    import moe_lightning.engine as eng_mod

    caches = []
    original = eng_mod.PagedKVCache

    def spy(*args, **kwargs):  # type: ignore[no-untyped-def]
        cache = original(*args, **kwargs)
        caches.append(cache)
        return cache

    monkeypatch.setattr(eng_mod, "PagedKVCache", spy)
    engine.generate([GenerationRequest([1, 2, 3], max_new_tokens=5), GenerationRequest([1], max_new_tokens=9)])
    assert caches[0].usage() == 0.0 and not caches[0].tables
    assert torch.is_tensor(caches[0].k)
