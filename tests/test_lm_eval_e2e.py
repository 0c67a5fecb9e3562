"""lm-evaluation-harness as a real client of the OpenAI gateway: its `local-completions` model runs a
multiple-choice task defined here (a YAML and a JSONL, no downloads), whose every request is echo +
logprobs over token ids, and each choice's log-likelihood it reports equals transformers' own on the
same checkpoint and the same tokens (docs/openai.md, "Prompt log-probabilities")."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from moe_lightning.launcher import Stack

from reference import load_hf

lm_eval = pytest.importorskip(
    "lm_eval", reason="lm-eval is not installed (make dev installs it where it can: Makefile, LM_EVAL)"
)

QUESTIONS = [
    ("Once upon a time there was a", ["little girl", "castle", "dragon who slept", "the"]),
    ("The sun rises in the", ["east", "west", "morning sky"]),
    ("She opened the door and saw", ["a cat", "nothing at all", "her old friend", "the sea", "rain"]),
    ("In the garden grew", ["roses", "tall green trees", "a"]),
    ("He said hello to", ["the baker", "everyone in the room", "his dog"]),
    ("Water is", ["wet", "a liquid at room temperature"]),
]


def write_task(root: Path) -> str:
    rows = [{"question": q, "choices": c, "answer": 0} for q, c in QUESTIONS]
    data = root / "tiny_mc.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    (root / "tiny_mc.yaml").write_text(
        "task: moe_lightning_tiny_mc\n"
        "dataset_path: json\n"
        "dataset_kwargs:\n"
        f"  data_files:\n    test: {data}\n"
        f"  cache_dir: {root / 'datasets-cache'}\n"  # hermetic: never the user's ~/.cache
        "test_split: test\n"
        "output_type: multiple_choice\n"
        'doc_to_text: "{{question}}"\n'
        'doc_to_choice: "{{choices}}"\n'
        'target_delimiter: " "\n'
        "doc_to_target: answer\n"
        "metric_list:\n  - metric: acc\n"
    )
    return "moe_lightning_tiny_mc"


@torch.no_grad()
def hf_loglikelihood(model: Any, context: list[int], continuation: list[int]) -> tuple[float, bool]:
    ids = torch.tensor([context + continuation])
    lp = torch.log_softmax(model(ids).logits[0].float(), dim=-1)
    rows = lp[len(context) - 1 : -1]  # row i predicts continuation token i
    picked = rows[torch.arange(len(continuation)), torch.tensor(continuation)]
    greedy = bool((rows.argmax(-1) == torch.tensor(continuation)).all())
    return float(picked.sum()), greedy


def test_multiple_choice_loglikelihoods_equal_transformers(
    tiny_model: Path, make_stack: Callable[..., Stack], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    from lm_eval import simple_evaluate
    from lm_eval.models.openai_completions import LocalCompletionsAPI
    from lm_eval.tasks import TaskManager

    stack = make_stack(model=tiny_model, http_port=0)
    task = write_task(tmp_path)
    lm = LocalCompletionsAPI(
        base_url=f"{stack.http_address}/v1/completions",
        model=stack.config.model.name,
        tokenizer=str(tiny_model),
        tokenizer_backend="huggingface",
        tokenized_requests=True,
        batch_size=4,  # prompts as lists of token-id lists, four a request
        max_retries=1,
        num_concurrent=2,
    )
    out = simple_evaluate(
        model=lm, tasks=[task], task_manager=TaskManager(include_path=str(tmp_path)), log_samples=True
    )
    samples = out["samples"][task]
    assert len(samples) == len(QUESTIONS)
    hf = load_hf(tiny_model)
    checked = 0
    for sample in samples:
        for (context, continuation), resp in zip(sample["arguments"], sample["resps"], strict=True):
            ctx, cont = lm._encode_pair(context, continuation)
            ll, greedy = resp[0]
            ref_ll, ref_greedy = hf_loglikelihood(hf, ctx, cont)
            assert ll == pytest.approx(ref_ll, abs=1e-3), (context, continuation)
            assert greedy == ref_greedy
            checked += 1
    assert checked == sum(len(c) for _, c in QUESTIONS)
    assert 0.0 <= out["results"][task]["acc,none"] <= 1.0
