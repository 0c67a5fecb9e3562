"""Prompt log-probabilities and the sampling controls through real processes, against transformers on
the same checkpoint: every prompt token's log-probability (prompts chunked over steps, mixed with decodes,
preempted and re-prefilled), and greedy tokens under repetition / frequency / presence penalties,
logit_bias, min_tokens and stop_token_ids, each against transformers' own logits processor or the same
rule applied to its logits (docs/openai.md, "Sampling")."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from moe_lightning.client import GenerationClient, Prompt
from moe_lightning.launcher import Stack

from reference import E2E_PROMPTS, load_hf

LONG = [1, *[(7 * i + 3) % 317 + 2 for i in range(90)]]  # spans several chunks of 16
PROMPTS = [*E2E_PROMPTS, LONG, LONG[:40]]
TOP = 3


@pytest.fixture(scope="module")
def hf(hf_dir: Path) -> Any:
    return load_hf(hf_dir)


@torch.no_grad()
def hf_prompt_logprobs(model: Any, prompt: list[int]) -> torch.Tensor:
    """(n - 1, V): log_softmax at positions 0..n-2, which predict prompt tokens 1..n-1."""
    return torch.log_softmax(model(torch.tensor([prompt])).logits[0, :-1].float(), dim=-1)


def assert_prompt_logprobs(model: Any, prompts: list[list[int]], done: list[Any]) -> None:
    for prompt, d in zip(prompts, done, strict=True):
        ref = hf_prompt_logprobs(model, prompt)
        assert len(d.prompt_logprobs) == len(prompt) - 1
        for j, entry in enumerate(d.prompt_logprobs):
            assert entry["token_id"] == prompt[j + 1]
            assert math.isclose(entry["logprob"], float(ref[j, prompt[j + 1]]), abs_tol=2e-4)
            values, _ = torch.topk(ref[j], TOP)
            assert entry["top_logprobs"] == pytest.approx(values.tolist(), abs=2e-4)
            for t, v in zip(entry["top_token_ids"], entry["top_logprobs"], strict=True):
                assert math.isclose(float(ref[j, t]), v, abs_tol=2e-4)  # ties may order ids either way


def test_prompt_logprobs_chunked_and_mixed_with_decodes_match_transformers(
    hf: Any, make_stack: Callable[..., Stack]
) -> None:
    # a 16-token prefill budget: LONG spans six steps, which decode the others as they go
    stack = make_stack(prefill_budget=16)
    with GenerationClient(stack.api_address, timeout=300) as c:
        asked = [Prompt(token_ids=p, max_new_tokens=6, prompt_logprobs=TOP) for p in PROMPTS]
        plain = [Prompt(token_ids=p, max_new_tokens=6) for p in PROMPTS]
        done = c.batch_generate(asked + plain)
    assert_prompt_logprobs(hf, PROMPTS, done[: len(PROMPTS)])
    # asking changes nothing else
    assert [d.token_ids for d in done[: len(PROMPTS)]] == [d.token_ids for d in done[len(PROMPTS) :]]
    assert all(not d.prompt_logprobs for d in done[len(PROMPTS) :])


def test_prompt_logprobs_survive_preemption(hf: Any, hf_dir: Path, make_stack: Callable[..., Stack]) -> None:
    from test_preemption_e2e import tight_stack

    stack = tight_stack(make_stack, hf_dir, 2 * (len(LONG) + 20), extra={"cpu_attention": ["--block-size", "4"]})
    prompts = PROMPTS * 3
    with GenerationClient(stack.api_address, timeout=300) as c:
        done = c.batch_generate([Prompt(token_ids=p, max_new_tokens=20, prompt_logprobs=TOP) for p in prompts])
    assert sum(d.preemptions for d in done) > 0
    assert_prompt_logprobs(hf, prompts, done)


@torch.no_grad()
def greedy_with(
    model: Any, prompt: list[int], steps: int, process: Callable[[list[int], torch.Tensor], torch.Tensor]
) -> list[int]:
    """Greedy tokens of transformers' logits after `process(output so far, logits)`, one full forward per step."""
    ids, out = list(prompt), []
    for _ in range(steps):
        logits = model(torch.tensor([ids])).logits[0, -1].float()
        token = int(process(out, logits).argmax())
        out.append(token)
        ids.append(token)
    return out


def openai_penalties(presence: float, frequency: float) -> Callable[[list[int], torch.Tensor], torch.Tensor]:
    def process(out: list[int], logits: torch.Tensor) -> torch.Tensor:
        counts = torch.bincount(torch.tensor(out, dtype=torch.long), minlength=logits.shape[0]).float()
        return logits - frequency * counts - presence * (counts > 0).float()

    return process


def test_sampling_controls_match_transformers(hf: Any, make_stack: Callable[..., Stack]) -> None:
    from transformers import (
        MinNewTokensLengthLogitsProcessor,
        RepetitionPenaltyLogitsProcessor,
        SequenceBiasLogitsProcessor,
    )

    stack = make_stack()
    steps = 12
    prompts = E2E_PROMPTS[:6]
    bias = {5: 8.0, 9: -100.0, 77: 3.5}
    cases: list[tuple[dict[str, Any], Callable[[list[int], list[int], torch.Tensor], torch.Tensor]]] = []

    def hf_processor(proc: Any) -> Callable[[list[int], list[int], torch.Tensor], torch.Tensor]:
        return lambda prompt, out, logits: proc(torch.tensor([prompt + out]), logits[None])[0]

    cases.append(({"repetition_penalty": 1.8}, hf_processor(RepetitionPenaltyLogitsProcessor(1.8))))
    cases.append(({"repetition_penalty": 0.6}, hf_processor(RepetitionPenaltyLogitsProcessor(0.6))))
    pen = openai_penalties(0.7, 1.3)
    cases.append(({"presence_penalty": 0.7, "frequency_penalty": 1.3}, lambda prompt, out, logits: pen(out, logits)))
    seq_bias = SequenceBiasLogitsProcessor({(t,): b for t, b in bias.items()})
    cases.append(({"logit_bias": bias}, hf_processor(seq_bias)))
    eos = hf.config.eos_token_id

    def min_tokens(prompt: list[int], out: list[int], logits: torch.Tensor) -> torch.Tensor:
        biased = logits.clone()
        biased[eos] += 50.0  # the bias makes EOS the argmax: only min_tokens holds it off
        return MinNewTokensLengthLogitsProcessor(len(prompt), 5, eos)(torch.tensor([prompt + out]), biased[None])[0]

    cases.append(({"logit_bias": {eos: 50.0}, "min_tokens": 5}, min_tokens))
    with GenerationClient(stack.api_address, timeout=300) as c:
        inputs = [Prompt(token_ids=p, max_new_tokens=steps, **kw) for kw, _ in cases for p in prompts]
        done = c.batch_generate(inputs)
    i = 0
    for kw, process in cases:
        for prompt in prompts:
            expected = greedy_with(hf, prompt, steps, lambda out, logits, p=prompt, f=process: f(p, out, logits))
            if eos in expected:  # the output ends at EOS (its token kept, as transformers' generate keeps it)
                expected = expected[: expected.index(eos) + 1]
            assert done[i].token_ids == expected, (kw, prompt)
            i += 1
    ended = done[-len(prompts) :]  # min_tokens 5 under a +50 EOS bias: exactly five tokens, then EOS
    assert all(d.token_ids[-1] == eos and len(d.token_ids) == 6 and d.finish_reason == "eos" for d in ended)


def test_stop_token_ids_end_the_output_as_eos_does(tiny_model: Path, make_stack: Callable[..., Stack]) -> None:
    stack = make_stack(model=tiny_model)
    with GenerationClient(stack.api_address, timeout=120) as c:
        base = {"text": "Once upon a time", "max_new_tokens": 12, "ignore_eos": True}  # (stop ids still end it)
        free = c.generate(Prompt(**base))
        stop_at = free.token_ids[4]
        first = free.token_ids.index(stop_at)
        stopped = c.generate(Prompt(**base, stop_token_ids=[stop_at]))
        late = c.generate(Prompt(**base, stop_token_ids=[stop_at], min_tokens=8))
    assert stopped.token_ids == free.token_ids[: first + 1] and stopped.finish_reason == "stop"
    assert stopped.text == c_decode(tiny_model, free.token_ids[:first])
    assert len(late.token_ids) > first + 1 and stop_at not in late.token_ids[:8]


def c_decode(model: Path, ids: list[int]) -> str:
    from moe_lightning.tokenizer import TextTokenizer

    tok = TextTokenizer.from_model_dir(model)
    assert tok is not None
    return tok.decode(ids)
