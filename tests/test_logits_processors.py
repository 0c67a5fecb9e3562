"""The batched logits controls (moe_lightning/logits_processors.py) against a row-by-row rendering of
each rule, and transformers' own processors; token masks in the wire layout; the rows that ask for
nothing untouched, bit for bit, and not even copied when no row asks."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import RepetitionPenaltyLogitsProcessor

from moe_lightning.logits_processors import apply_token_masks, mask_words, process_logits
from moe_lightning.sampling import SamplingParams, SequenceSampler

V = 97  # not a multiple of 32: the last mask word is partial
EOS = (2,)


def sampler(params: SamplingParams, prompt: list[int], output: list[int]) -> SequenceSampler:
    s = SequenceSampler.start(params, prompt_len=len(prompt))
    s.feed(0, prompt + output)
    s.draws = len(output)
    return s


def mask_bytes(allowed: list[int]) -> bytes:
    words = np.zeros(mask_words(V), dtype="<i4")
    for t in allowed:
        words[t // 32] |= np.int32(1 << (t % 32)) if t % 32 != 31 else np.int32(-(2**31))
    return words.tobytes()


def test_nothing_asked_returns_the_same_tensor() -> None:
    logits = torch.randn(3, V)
    out = process_logits(logits, [sampler(SamplingParams(), [1, 2], [3]) for _ in range(3)], EOS)
    assert out is logits


def test_each_control_matches_its_rule_and_other_rows_stay_bit_identical() -> None:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(5, V, generator=g)
    prompt, output = [1, 5, 5, 9], [9, 9, 40, 5]
    params = [
        SamplingParams(),
        SamplingParams(repetition_penalty=1.7),
        SamplingParams(presence_penalty=0.4, frequency_penalty=-0.9),
        SamplingParams(logit_bias=((3, 7.5), (96, -100.0))),
        SamplingParams(min_tokens=10, stop_token_ids=(11,)),
    ]
    out = process_logits(logits, [sampler(p, prompt, output) for p in params], EOS)
    assert torch.equal(out[0], logits[0])
    rep = RepetitionPenaltyLogitsProcessor(1.7)(torch.tensor([prompt + output]), logits[1:2].clone())[0]
    assert torch.allclose(out[1], rep)
    counts = torch.bincount(torch.tensor(output), minlength=V).float()
    assert torch.allclose(out[2], logits[2] - (-0.9) * counts - 0.4 * (counts > 0).float())
    want = logits[3].clone()
    want[3] += 7.5
    want[96] -= 100.0
    assert torch.equal(out[3], want)
    assert torch.isinf(out[4, [2, 11]]).all() and torch.equal(out[4, 12:], logits[4, 12:])


def test_token_masks_allow_exactly_their_bits() -> None:
    logits = torch.randn(3, V)
    allowed = [0, 31, 32, 63, 95, 96]
    out = logits.clone()
    apply_token_masks(out, [1], [mask_bytes(allowed)])
    assert torch.equal(out[0], logits[0]) and torch.equal(out[2], logits[2])
    assert torch.isfinite(out[1]).nonzero().flatten().tolist() == allowed


def test_a_grammar_that_can_only_end_wins_over_min_tokens() -> None:
    logits = torch.randn(2, V)
    s = [sampler(SamplingParams(min_tokens=5), [1], []), sampler(SamplingParams(min_tokens=5), [1], [])]
    out = process_logits(logits, s, EOS, [mask_bytes([2]), mask_bytes([2, 7])])
    assert int(out[0].argmax()) == 2  # the grammar's end (EOS) stays, though min_tokens would mask it
    assert int(out[1].argmax()) == 7 and torch.isinf(out[1, 2])  # another way on: min_tokens holds


def test_a_sample_thrown_away_is_not_processed() -> None:
    """A chunk short of its prompt's end samples a token nobody keeps: its history is not complete."""
    s = SequenceSampler.start(SamplingParams(repetition_penalty=2.0), draws=3, prompt_len=10)
    s.feed(0, [1, 2, 3, 4])  # 4 of the prompt's 10 tokens and 3 generated are still to come
    assert not s.complete
    logits = torch.randn(1, V)
    assert process_logits(logits, [s], EOS) is logits


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here")
def test_on_cuda_the_masks_apply_on_the_device() -> None:
    logits = torch.randn(2, V, device="cuda")
    out = process_logits(
        logits, [sampler(SamplingParams(logit_bias=((4, 1.0),)), [1], [])] * 2, EOS, [None, mask_bytes([4])]
    )
    assert out.device.type == "cuda" and torch.isfinite(out[1]).nonzero().flatten().tolist() == [4]
