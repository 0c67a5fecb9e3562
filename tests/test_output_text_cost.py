"""OutputText's per-token work (issue 14, item 6): the stop search and hold-back cost what the new text
costs, whatever the output's length or the stop strings' lengths, and they hold back and cut exactly what
a brute-force search of the whole text would."""

from __future__ import annotations

import random
import time

from moe_lightning.demo_model import build_tokenizer
from moe_lightning.output_text import OutputText
from moe_lightning.request import FINISH_LENGTH, FINISH_STOP, GenerationRequest
from moe_lightning.tokenizer import TextTokenizer

TOK = TextTokenizer(build_tokenizer(400, seed=1))
EOS = 2


def _ids(text: str) -> list[int]:
    return TOK.encode(text)[1:]  # without the BOS


def test_streaming_64k_characters_costs_the_same_per_token_at_the_end_as_at_the_start() -> None:
    """A 1 MB stop string (no validation here: OutputText itself must not depend on it) and 16 stops
    that keep matching part of the text: before, a token at 64k characters cost 178 ms."""
    ids = _ids("Kabeno tisar molu " * 3700)  # ~66k characters
    stops = ("Q" + "x" * (1 << 20), *(("Kabeno tisar molu " * 15)[i:][:250] + "!" for i in range(15)))
    output = OutputText(GenerationRequest([1], len(ids), stop=stops), (EOS,), TOK, stream=True)
    block = 500
    sent, costs = [], []
    for start in range(0, len(ids), block):
        t0 = time.perf_counter()
        for t in ids[start : start + block]:
            delta, reason = output.append(t)
            sent.append(delta)
        costs.append(time.perf_counter() - t0)
        # a generous bound (a shared CI machine), checked as it goes: quadratic work fails long before the end
        assert costs[-1] < 10 * min(costs) + 0.25, f"block {len(costs)}: {costs[-1]:.3f} s vs {min(costs):.3f} s"
    assert reason == FINISH_LENGTH and len(output.final_text or "") > 64_000
    assert "".join(sent) == output.final_text


def _held(text: str, stops: tuple[str, ...]) -> int:
    return max((n for s in stops for n in range(1, len(s)) if text.endswith(s[:n])), default=0)


def test_hold_back_and_cut_match_a_brute_force_search() -> None:
    rng = random.Random(14)
    for _ in range(150):
        text = "".join(rng.choice("ab ") for _ in range(rng.randint(1, 60)))
        stops = tuple("".join(rng.choice("ab") for _ in range(rng.randint(1, 6))) for _ in range(rng.randint(1, 4)))
        ids = _ids(text)
        output = OutputText(GenerationRequest([1], len(ids), stop=stops), (EOS,), TOK, stream=True)
        sent = ""
        for i, t in enumerate(ids):
            delta, reason = output.append(t)
            sent += delta
            so_far = TOK.decode(ids[: i + 1])  # ASCII: the incremental text is the whole decode
            hits = [j for j in (so_far.find(s) for s in stops) if j >= 0]
            if hits:
                assert reason == FINISH_STOP and output.final_text == sent == so_far[: min(hits)]
                break
            if reason is not None:
                assert sent == output.final_text == so_far
                break
            assert sent == so_far[: len(so_far) - _held(so_far, stops)], (text, stops, i)
