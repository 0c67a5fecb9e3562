"""Incremental detokenization: the same text as decoding everything at once, for a byte-level BPE
(the demo's, as GPT-2/Qwen/OLMoE/DBRX) and a SentencePiece-style one (Metaspace, as Mixtral's), on
random token sequences that split UTF-8 characters; stop strings and streamed text built on it (OutputText)."""

from __future__ import annotations

import random

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from moe_lightning.demo_model import build_tokenizer
from moe_lightning.detokenize import IncrementalDetokenizer
from moe_lightning.output_text import OutputText
from moe_lightning.request import FINISH_LENGTH, FINISH_STOP, GenerationRequest, InvalidRequestError
from moe_lightning.tokenizer import TextTokenizer

CORPUS = ["Grüße aus Köln — naïve café, 東京 and émigré", "the quick brown fox. ¿Qué tal? 🙂 ok"] * 50


def _metaspace() -> Tokenizer:
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=120, special_tokens=["<unk>", "<s>", "</s>"]))
    return tok


@pytest.fixture(scope="module", params=["byte-level", "metaspace"])
def tokenizer(request: pytest.FixtureRequest) -> TextTokenizer:
    if request.param == "byte-level":
        return TextTokenizer(build_tokenizer(400, seed=1))
    return TextTokenizer(_metaspace())


def _sequences(tok: TextTokenizer, n: int = 40) -> list[list[int]]:
    rng = random.Random(0)
    real = [tok.encode(line)[1:] if tok.encode(line)[:1] == [1] else tok.encode(line) for line in CORPUS[:2]]
    out = [real[0], real[1]]
    for _ in range(n):  # random ids: byte tokens that cut characters, special tokens, anything
        out.append([rng.randrange(tok.vocab_size) for _ in range(rng.randint(1, 30))])
    return out


def test_pieces_add_up_to_the_whole_decode(tokenizer: TextTokenizer) -> None:
    for ids in _sequences(tokenizer):
        detok = IncrementalDetokenizer(tokenizer)
        pieces = [detok.push([t]) for t in ids]
        full = tokenizer.decode(ids)
        assert "".join(pieces) == detok.text
        # everything but a trailing partial character is out
        assert full.startswith(detok.text) and (detok.text == full or full.endswith("\ufffd"))


def test_stop_is_found_where_decoding_everything_finds_it(tokenizer: TextTokenizer) -> None:
    rng = random.Random(1)
    checked = 0
    for ids in _sequences(tokenizer):
        full = tokenizer.decode(ids)
        if len(full) < 4:
            continue
        i = rng.randrange(len(full) - 2)
        stop = full[i : i + rng.randint(1, 3)]
        if "\ufffd" in stop:  # a stop made of an invalid byte's stand-in is matched one token later
            continue
        output = OutputText(GenerationRequest([1], len(ids) + 1, stop=(stop,)), (), tokenizer)
        reason, n = None, 0
        while reason is None and n < len(ids):
            n += 1
            _, reason = output.append(ids[n - 1])
        # the reference: the first prefix whose whole decode contains the stop
        first = next(k for k in range(1, len(ids) + 1) if stop in tokenizer.decode(ids[:k]))
        assert (reason, n) == (FINISH_STOP, first)
        text = tokenizer.decode(ids[:n])
        assert output.final_text == text[: text.find(stop)]
        checked += 1
    assert checked >= 20


def test_streamed_text_holds_back_a_possible_stop_and_adds_up(tokenizer: TextTokenizer) -> None:
    ids = _sequences(tokenizer)[0]
    full = tokenizer.decode(ids)
    stop = full[10:14]
    output = OutputText(GenerationRequest([1], len(ids) + 1, stop=(stop,)), (), tokenizer, stream=True)
    sent = []
    for t in ids:
        delta, reason = output.append(t)
        sent.append(delta)
        assert stop not in "".join(sent)  # never shown, not even in part before it is ruled out
        if reason is not None:
            break
    final = output.final_text
    # the finishing token's delta completes the text: no separate flush at the end
    assert "".join(sent) == final == full[: full.find(stop)]
    assert stop[0] in full[: full.find(stop) + 1]  # the held part was the stop's first characters


def test_without_stops_or_a_tokenizer() -> None:
    tok = TextTokenizer(build_tokenizer(400, seed=1))
    ids = tok.encode("Kabeno tisar molu")
    stream = OutputText(GenerationRequest([1], len(ids)), (), tok, stream=True)
    pieces = [stream.append(t) for t in ids]
    assert "".join(d for d, _ in pieces) == stream.final_text == tok.decode(ids)
    assert [r for _, r in pieces] == [None] * (len(ids) - 1) + [FINISH_LENGTH]
    silent = OutputText(GenerationRequest([1], 2), (), None, stream=True)
    assert [silent.append(5), silent.append(6)] == [("", None), ("", FINISH_LENGTH)] and silent.final_text is None
    with pytest.raises(InvalidRequestError, match="stop strings need"):  # a stop could never be matched
        OutputText(GenerationRequest([1], 2, stop=("x",)), (), None)
