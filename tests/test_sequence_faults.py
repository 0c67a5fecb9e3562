"""A fault belongs to its sequence (issue 54): whatever raises for one sequence of a step (a row the head
could not sample, its output's text) ends that sequence alone, with INVALID_ARGUMENT where its own input
caused it, while the step's other sequences keep exactly their tokens and the backend is not reset; a
failed step's requests are told which step failed and why, never a transport's bare "Stream removed".
The scheduler loop around the fake backend (real threads, no processes), as test_scheduler_loop.py."""

from __future__ import annotations

import os
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
import torch
from fake_backend import FAKE_KV, FakeBackend, running_scheduler
from runner_pair import arena_of, wired

from moe_lightning import grammar as grammar_module
from moe_lightning.arena import weights_from_arena
from moe_lightning.grammar import GrammarSpec
from moe_lightning.logits_processors import mask_words
from moe_lightning.output_text import OutputText
from moe_lightning.request import FINISH_LENGTH, GenerationRequest
from moe_lightning.sampling import SamplingParams
from moe_lightning.service.errors import ServiceError, UnavailableError, status_for
from moe_lightning.spec import ModelSpec
from moe_lightning.step_protocol import SequenceFault, SequenceWork, StepKind, StepPlan
from moe_lightning.tokenizer import TextTokenizer
from moe_lightning.weights import ModelWeights
from orchestrator.batcher import ScheduledStep, Sequence
from orchestrator.grammars import Grammars
from orchestrator.scheduler import Scheduler
from orchestrator.step_faults import worker_error
from services.gpu_expert.runner import ExpertRunner

KV = FAKE_KV
NEW = 6


@pytest.fixture()
def loop(tiny_model: Path) -> Iterator[tuple[Scheduler, FakeBackend]]:
    with running_scheduler(tiny_model) as pair:
        yield pair


def _request() -> GenerationRequest:
    return GenerationRequest([5, 6, 7], NEW, ignore_eos=True)


def _cobatched(s: Scheduler, backend: FakeBackend, n: int = 17) -> list:
    """n requests, all in the second step: the first step holds the first alone at the gate while the
    others queue; the caller sets the gate."""
    backend.gate.clear()
    first = s.submit(_request())
    assert backend.entered.wait(10)
    return [first, *(s.submit(_request()) for _ in range(n - 1))]


def _fake_tokens(seq_id: int) -> list[int]:
    """What FakeBackend generates for a sequence: its tokens had nothing happened beside it."""
    return [10 + (seq_id + i) % 50 for i in range(NEW)]


def _others_finish_exactly(s: Scheduler, backend: FakeBackend, tickets: list, victim: object) -> None:
    others = [t for t in tickets if t is not victim]
    assert len(others) == 16 and max(p.num_sequences for p in backend.plans) == 17  # co-batched with it
    for t in others:
        result = t.wait(30)
        assert result.finish_reason == FINISH_LENGTH and result.token_ids == _fake_tokens(t.seq.seq_id)
    assert not s.backend_lost.is_set() and s.alive
    assert any(victim.seq.seq_id in p.release for p in backend.plans)  # type: ignore[attr-defined]  # its state dropped
    assert s.stats() == {"waiting": 0, "running": 0, "free_blocks": KV.blocks, "preemptions": 0}


@pytest.mark.parametrize("invalid_argument", [True, False], ids=["its-controls", "the-model"])
def test_a_sequence_the_head_could_not_sample_ends_alone(
    loop: tuple[Scheduler, FakeBackend], invalid_argument: bool
) -> None:
    """gpu_expert flags a row whose logits were not finite (StepResponse.faults): that request ends with
    the head's message, the 16 beside it get every token, nothing is reset."""
    s, backend = loop
    tickets = _cobatched(s, backend)
    victim = tickets[8]
    message = "this request's sampling controls made its logits non-finite (NaN or inf)"
    backend.faults[victim.seq.seq_id] = SequenceFault(message, invalid_argument)
    backend.gate.set()
    with pytest.raises(ServiceError, match=r"made its logits non-finite") as info:
        victim.wait(30)
    want = grpc.StatusCode.INVALID_ARGUMENT if invalid_argument else grpc.StatusCode.INTERNAL
    assert status_for(info.value) == want
    _others_finish_exactly(s, backend, tickets, victim)


def test_a_sequence_whose_output_raises_ends_alone(
    loop: tuple[Scheduler, FakeBackend], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its detokenizer or stop strings raising used to abort the whole step: 17 of 17 ended INTERNAL."""
    s, backend = loop
    tickets = _cobatched(s, backend)
    victim = tickets[5]
    real = OutputText.append

    def append(self: OutputText, token: int) -> tuple[str, str | None]:
        if self is victim.seq.text:
            raise RuntimeError("the detokenizer failed")
        return real(self, token)

    monkeypatch.setattr(OutputText, "append", append)
    backend.gate.set()
    with pytest.raises(ServiceError, match="internal error on this request's output.*the detokenizer failed"):
        victim.wait(30)
    _others_finish_exactly(s, backend, tickets, victim)


def test_a_failed_step_says_which_step_failed_and_why(loop: tuple[Scheduler, FakeBackend]) -> None:
    s, backend = loop
    backend.fail = ServiceError("attention failed: boom", grpc.StatusCode.INTERNAL)
    with pytest.raises(ServiceError, match=r"^step 1 \(prefill\) failed: attention failed: boom; the request"):
        s.submit(_request()).wait(30)
    assert not s.backend_lost.is_set()
    backend.down = UnavailableError("step 2 (prefill, 1 sequences) lost its backend: gpu_expert answered UNAVAILABLE")
    with pytest.raises(UnavailableError, match="lost its backend.*died or restarted during the step.*retry it"):
        s.submit(_request()).wait(30)
    assert s.backend_lost.is_set()


def _rpc_error(code: grpc.StatusCode, details: str) -> grpc.RpcError:
    """What a real gRPC call raises when the server answers `code` (gpu_expert's Step, say)."""
    server = grpc.server(ThreadPoolExecutor(1))

    def fail(request: bytes, context: grpc.ServicerContext) -> bytes:
        context.abort(code, details)
        return b""

    handler = grpc.unary_unary_rpc_method_handler(fail)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("t.T", {"F": handler}),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            channel.unary_unary("/t.T/F")(b"", timeout=10)
    except grpc.RpcError as exc:
        return exc
    finally:
        server.stop(0)
    raise AssertionError("the call did not fail")


def test_gpu_experts_answer_decides_whether_the_worker_is_lost() -> None:
    """A step that raised in a live gpu_expert (INTERNAL) used to read as a lost backend: every request in
    flight ended UNAVAILABLE and the KV was dropped. Only a worker that is gone (UNAVAILABLE, a deadline,
    a restarted worker's FAILED_PRECONDITION) is."""
    plan = StepPlan(7, [], StepKind.DECODE)
    failed = worker_error(plan, _rpc_error(grpc.StatusCode.INTERNAL, "internal error in attention: kaboom"))
    assert status_for(failed) == grpc.StatusCode.INTERNAL
    assert str(failed) == "step 7 (decode, 0 sequences) failed in gpu_expert: internal error in attention: kaboom"
    for code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.FAILED_PRECONDITION):
        lost = worker_error(plan, _rpc_error(code, "Stream removed"))
        assert status_for(lost) == grpc.StatusCode.UNAVAILABLE
        assert (
            str(lost)
            == f"step 7 (decode, 0 sequences) lost its backend: gpu_expert answered {code.name} (Stream removed)"
        )


BAD_TOKEN = 11  # its embedding row is NaN below: a checkpoint with one bad row


@pytest.fixture()
def pair(tiny_model: Path) -> Iterator[tuple[ExpertRunner, ModelWeights]]:
    spec, arena, layout = arena_of(tiny_model)
    device = torch.device("cpu")
    weights = weights_from_arena(arena, layout, spec, device, experts_on_host=True)
    with wired(spec, weights, device, f"seqfault{os.getpid()}", spec.num_experts, lookahead=False) as (runner, _):
        yield runner, weights


def test_a_real_step_flags_its_non_finite_rows_and_samples_the_others_as_without_them(
    pair: tuple[ExpertRunner, ModelWeights],
) -> None:
    """A real runner and attention worker: a sequence whose prompt meets a NaN embedding row (the model's
    fault: INTERNAL) and one whose controls allow no token (an empty grammar mask: the request's, 400)
    are flagged in StepOutput.faults with no token of theirs used; greedy, temperature, top-p and top-k
    rows beside them get the tokens they get in a step without them. It used to sample them anyway."""
    runner, weights = pair
    weights.embed[BAD_TOKEN] = float("nan")
    params = [
        SamplingParams(),
        SamplingParams(temperature=1.0, seed=3),
        SamplingParams(temperature=0.8, top_p=0.9, seed=4),
        SamplingParams(temperature=1.0, top_k=5, seed=5),
    ]

    def sound(first: int) -> list[SequenceWork]:
        return [SequenceWork(first + i, [5 + i, 7, 9], 0, p) for i, p in enumerate(params)]

    nothing_allowed = bytes(4 * mask_words(weights.embed.shape[0]))
    faulty = [
        SequenceWork(50, [5, BAD_TOKEN, 9], 0, params[0]),
        SequenceWork(51, [6, 7, BAD_TOKEN], 0, params[1]),
        SequenceWork(52, [5, 7, 9], 0, params[2], token_mask=nothing_allowed),
    ]
    works = sound(10)
    out = runner.step(StepPlan(1, [works[:2] + faulty[:2], works[2:] + faulty[2:]], StepKind.PREFILL))
    assert sorted(out.faults) == [50, 51, 52]
    assert not out.faults[50].invalid_argument and "the model produced non-finite logits" in out.faults[50].message
    assert not out.faults[51].invalid_argument
    assert out.faults[52].invalid_argument and "allow no token" in out.faults[52].message
    got = dict(zip(out.seq_ids, out.token_ids, strict=True))
    alone = runner.step(StepPlan(2, [sound(20)], StepKind.PREFILL))
    assert [got[10 + i] for i in range(len(params))] == alone.token_ids


def test_a_mask_that_cannot_be_filled_faults_its_sequence_alone(
    tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The library raising in the batched fill (fault injected: llguidance reports its own limits in the
    state, so no input of ours makes it raise) is narrowed to the row at fault: that sequence ends with
    INVALID_ARGUMENT, the others get their masks. It used to fail every sequence of the step."""
    spec = ModelSpec.from_pretrained(tiny_model)
    grammars = Grammars(spec, TextTokenizer.from_model_dir(tiny_model))
    seqs = []
    for i in range(4):
        request = GenerationRequest([5, 6, 7], NEW, grammar=GrammarSpec.choice(["yes", "no"]))
        seqs.append(
            Sequence(i, request, OutputText(request, spec.eos_token_ids, None), grammar=grammars.start(request))
        )
    works = [SequenceWork(s.seq_id, [5, 6, 7], 0, SamplingParams()) for s in seqs]
    real = grammar_module.fill_bitmask

    def fill(states: list, bitmask: torch.Tensor) -> None:
        if seqs[2].grammar in states:
            raise RuntimeError("the mask executor failed")
        real(states, bitmask)

    monkeypatch.setattr(grammar_module, "fill_bitmask", fill)
    faults = grammars.attach_masks(ScheduledStep(StepPlan(1, [works], StepKind.PREFILL), seqs))
    assert [(s.seq_id, str(e)) for s, e in faults] == [
        (2, "the request's grammar could not compute its next token mask: the mask executor failed")
    ]
    assert status_for(faults[0][1]) == grpc.StatusCode.INVALID_ARGUMENT
    assert [w.token_mask is not None for w in works] == [True, True, False, True]
    assert works[0].token_mask == works[1].token_mask == works[3].token_mask and any(works[0].token_mask)
