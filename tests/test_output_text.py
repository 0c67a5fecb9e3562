"""OutputText: each token's stream delta together with the finish reason, on the demo's byte-level
tokenizer -- a stop string split across tokens, a UTF-8 character split across tokens, EOS."""

from __future__ import annotations

import pytest

from moe_lightning.demo_model import build_tokenizer
from moe_lightning.output_text import OutputText
from moe_lightning.request import FINISH_EOS, FINISH_LENGTH, FINISH_STOP, GenerationRequest
from moe_lightning.tokenizer import TextTokenizer

TOK = TextTokenizer(build_tokenizer(400, seed=1))
EOS = 2  # the demo's </s>: a special token, decoded as ""


def _ids(text: str) -> list[int]:
    return TOK.encode(text)[1:]  # without the BOS


def _run(output: OutputText, ids: list[int]) -> list[tuple[str, str | None]]:
    steps = []
    for t in ids:
        steps.append(output.append(t))
        if steps[-1][1] is not None:
            break
    return steps


def _stream(ids: list[int], max_new: int | None = None, **kwargs: object) -> OutputText:
    request = GenerationRequest([1], max_new or len(ids), **kwargs)  # type: ignore[arg-type]
    return OutputText(request, (EOS,), TOK, stream=True)


def test_a_stop_split_across_tokens_is_held_then_cut() -> None:
    ids = _ids("Kabeno tisar molu")
    assert [TOK.decode([t]) for t in ids[:6]] == ["K", "a", "ben", "o", " t", "is"]
    output = _stream(ids, stop=("o ti",))
    # "o" and "o t" could begin the stop: held back; "o ti" completes it: never sent, output ends before it
    assert _run(output, ids) == [("K", None), ("a", None), ("ben", None), ("", None), ("", None), ("", FINISH_STOP)]
    assert output.final_text == "Kaben" and output.token_ids == ids[:6]


def test_held_text_is_released_once_it_cannot_be_a_stop() -> None:
    ids = _ids("Kabeno tisar molu")
    output = _stream(ids, stop=("o tx",))
    steps = _run(output, ids)
    assert steps[:6] == [("K", None), ("a", None), ("ben", None), ("", None), ("", None), ("o tis", None)]
    assert steps[-1][1] == FINISH_LENGTH
    assert "".join(d for d, _ in steps) == output.final_text == "Kabeno tisar molu"


def test_a_character_split_across_tokens_is_sent_whole() -> None:
    ids = _ids("x🙂y")
    assert len(ids) == 6  # x, four bytes of the emoji, y
    output = _stream(ids)
    assert _run(output, ids) == [("x", None), ("", None), ("", None), ("", None), ("🙂", None), ("y", FINISH_LENGTH)]
    assert output.final_text == "x🙂y"


def test_a_stop_that_follows_a_split_character() -> None:
    ids = _ids("x🙂y")
    output = _stream(ids, stop=("🙂y",))
    steps = _run(output, ids)
    assert all(d == "" for d, _ in steps[1:]) and steps[-1] == ("", FINISH_STOP)  # the emoji was held too
    assert output.final_text == "x"


def test_a_budget_that_ends_inside_a_character_sends_what_decoding_all_gives() -> None:
    ids = _ids("x🙂")[:3]
    output = _stream(ids)
    steps = _run(output, ids)
    assert [r for _, r in steps] == [None, None, FINISH_LENGTH]
    assert "".join(d for d, _ in steps) == output.final_text == TOK.decode(ids)
    assert output.final_text.endswith("\ufffd")  # type: ignore[union-attr]


@pytest.mark.parametrize("eos", [EOS, 81])  # 81 is "o": an EOS id that has text of its own
def test_eos_ends_the_output_and_is_no_part_of_the_text(eos: int) -> None:
    ids = [*_ids("Kaben"), eos, *_ids("ab")]
    output = OutputText(GenerationRequest([1], 20), (eos,), TOK, stream=True)
    steps = _run(output, ids)
    assert steps[-1][1] == FINISH_EOS and output.token_ids == [*_ids("Kaben"), eos]
    assert "".join(d for d, _ in steps) == output.final_text == "Kaben"
    ignored = OutputText(GenerationRequest([1], len(ids), ignore_eos=True), (eos,), TOK, stream=True)
    assert _run(ignored, ids)[-1][1] == FINISH_LENGTH and len(ignored.token_ids) == len(ids)


def test_without_streaming_the_text_comes_with_the_finishing_token() -> None:
    ids = _ids("Kabeno tisar")
    output = OutputText(GenerationRequest([1], len(ids)), (EOS,), TOK)
    steps = _run(output, ids)
    assert steps[:-1] == [("", None)] * (len(ids) - 1) and steps[-1] == ("Kabeno tisar", FINISH_LENGTH)
    stopped = OutputText(GenerationRequest([1], len(ids), stop=("ti",)), (EOS,), TOK)
    assert _run(stopped, ids)[-1] == ("Kabeno ", FINISH_STOP)


def test_no_token_after_the_finish() -> None:
    output = _stream([5], 1)
    assert output.append(5)[1] == FINISH_LENGTH
    with pytest.raises(ValueError, match="already finished"):
        output.append(6)


def test_under_min_tokens_the_grammar_s_end_ends_the_output() -> None:
    """The head lets EOS through under min_tokens only where the grammar allows nothing else (issue 54):
    the output ends there, with the grammar's text. Without a grammar min_tokens holds."""
    from moe_lightning.grammar import GrammarSpec
    from moe_lightning.sampling import SamplingParams

    ids = [*_ids("a"), EOS, *_ids("bc")]
    sampling = SamplingParams(min_tokens=8)
    guided = OutputText(GenerationRequest([1], 20, sampling, grammar=GrammarSpec.choice(["a"])), (EOS,), TOK)
    assert _run(guided, ids)[-1] == ("a", FINISH_EOS)
    plain = OutputText(GenerationRequest([1], len(ids), sampling), (EOS,), TOK)
    assert _run(plain, ids)[-1][1] == FINISH_LENGTH and len(plain.token_ids) == len(ids)
