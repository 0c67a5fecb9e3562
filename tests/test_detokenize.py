"""Incremental detokenization: the same text as decoding everything at once, for a byte-level BPE
(the demo's, as GPT-2/Qwen/OLMoE/DBRX) and a SentencePiece-style one (Metaspace, as Mixtral's), on
random token sequences that split UTF-8 characters; stop strings and streamed text built on it."""

from __future__ import annotations

import random

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from moe_lightning.demo_model import build_tokenizer
from moe_lightning.detokenize import IncrementalDetokenizer, StreamedText
from moe_lightning.request import FINISH_STOP, GenerationRequest
from moe_lightning.stopping import StopChecker
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


def test_stop_checker_finds_what_decoding_everything_finds(tokenizer: TextTokenizer) -> None:
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
        checker = StopChecker(GenerationRequest([1], len(ids) + 1, stop=(stop,)), (), tokenizer)
        reason, n = None, 0
        while reason is None and n < len(ids):
            n += 1
            reason = checker.check(ids[:n])
        # the reference: the first prefix whose whole decode contains the stop
        first = next(k for k in range(1, len(ids) + 1) if stop in tokenizer.decode(ids[:k]))
        assert (reason, n) == (FINISH_STOP, first)
        text = tokenizer.decode(ids[:n])
        assert checker.final_text(ids[:n]) == text[: text.find(stop)]
        checked += 1
    assert checked >= 20


def test_streamed_text_holds_back_a_possible_stop_and_adds_up(tokenizer: TextTokenizer) -> None:
    ids = _sequences(tokenizer)[0]
    full = tokenizer.decode(ids)
    stop = full[10:14]
    checker = StopChecker(GenerationRequest([1], len(ids) + 1, stop=(stop,)), (), tokenizer)
    stream = StreamedText(tokenizer, (stop,))
    sent = []
    for n in range(1, len(ids) + 1):
        sent.append(stream.feed(ids[n - 1 : n]))
        assert stop not in "".join(sent)  # never shown, not even in part before it is ruled out
        if checker.check(ids[:n]) is not None:
            break
    final = checker.final_text(ids[:n])
    sent.append(stream.finish(final))
    assert "".join(sent) == final == full[: full.find(stop)]
    assert stop[0] in full[: full.find(stop) + 1]  # the held part was the stop's first characters


def test_without_stops_or_a_tokenizer() -> None:
    tok = TextTokenizer(build_tokenizer(400, seed=1))
    ids = tok.encode("Kabeno tisar molu")
    stream = StreamedText(tok, ())
    assert "".join(stream.feed([t]) for t in ids) + stream.finish(tok.decode(ids)) == tok.decode(ids)
    silent = StreamedText(None, ("x",))
    assert silent.feed([5, 6]) == "" and silent.finish(None) == ""
