"""The expert runner is made of parts chosen once at start: its step branches on no optional
collaborator (pager, link, group, device KV cache), no placement flag and no part, and its order
(with the expert pages in it) is schedule.py's, op by op."""

from __future__ import annotations

import ast
from pathlib import Path

import grpc
import pytest
import torch

from moe_lightning.arena import ArenaLayout, fill_arena, weights_from_arena
from moe_lightning.placement import Placement, Side
from moe_lightning.sampling import SamplingParams
from moe_lightning.service.errors import NotReadyError, ServiceError
from moe_lightning.spec import ModelSpec
from moe_lightning.step_protocol import SequenceWork, StepKind, StepPlan
from services.gpu_expert.runner import ExpertRunner
from services.gpu_expert.schedule import (
    ATTEND,
    BEGIN,
    END,
    PREFETCH,
    RECEIVE,
    SEND,
    cgopipe_order,
    cgopipe_steps,
    local_steps,
    sequential_steps,
)

RUNNER = Path(__file__).parents[1] / "services" / "gpu_expert" / "runner.py"
COLLABORATORS = {"pager", "link", "group", "kv"}  # optional: None where a deployment has none
CHOSEN = COLLABORATORS | {"shard", "leads", "overlap", "count_syncs", "count_sync", "residency_interval"}
PLACEMENT = {"placement", "attention_on_device", "experts_on_host", "attention", "experts"}
PARTS = {"ranks", "handoff", "head", "local", "places", "counted", "stages", "source"}


def _names(node: ast.AST) -> set[str]:
    return {
        n.attr if isinstance(n, ast.Attribute) else n.id
        for n in ast.walk(node)
        if isinstance(n, ast.Attribute | ast.Name)
    }


def _branch_tests(fn: ast.AST) -> list[ast.expr]:
    """Every expression a branch of `fn` decides on."""
    tests: list[ast.expr] = []
    for node in ast.walk(fn):
        if isinstance(node, ast.If | ast.IfExp | ast.While | ast.Assert):
            tests.append(node.test)
        elif isinstance(node, ast.BoolOp):
            tests.extend(node.values)
        elif isinstance(node, ast.comprehension):
            tests.extend(node.ifs)
        elif isinstance(node, ast.Match):
            tests.append(node.subject)
    return tests


def _self_attributes(node: ast.AST) -> set[str]:
    return {
        n.attr
        for n in ast.walk(node)
        if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "self"
    }


def _step_methods(source: str) -> list[ast.FunctionDef]:
    """ExpertRunner's methods but its constructor, where the parts are chosen."""
    cls = next(n for n in ast.parse(source).body if isinstance(n, ast.ClassDef) and n.name == "ExpertRunner")
    return [f for f in cls.body if isinstance(f, ast.FunctionDef) and f.name != "__init__"]


def _offences(source: str) -> list[str]:
    found = []
    for fn in _step_methods(source):
        for test in _branch_tests(fn):
            names = _names(test)
            if bad := names & (CHOSEN | PLACEMENT | PARTS):
                found.append(f"{fn.name}: branches on {sorted(bad)}: {ast.unparse(test)}")
            for cmp in ast.walk(test):  # `self.x is None`: a collaborator that may be missing
                is_test = isinstance(cmp, ast.Compare) and any(isinstance(op, ast.Is | ast.IsNot) for op in cmp.ops)
                if is_test and _self_attributes(cmp):
                    found.append(f"{fn.name}: tests a part for None: {ast.unparse(cmp)}")
        if read := _self_attributes(fn) & COLLABORATORS:  # kept for the service; a step reads its parts
            found.append(f"{fn.name}: reads the collaborators {sorted(read)} instead of a part")
    return found


def test_the_runners_step_branches_on_no_optional_collaborator() -> None:
    assert _offences(RUNNER.read_text()) == []


def test_the_check_catches_a_branch_on_a_collaborator() -> None:
    """The check itself: the branches the runner once had are each caught."""
    old = """
class ExpertRunner:
    def __init__(self, pager):
        self.pager = pager
    def _step(self, plan):
        waited = self.pager.wait_seconds if self.pager is not None else 0.0
        if plan.placement.attention_on_device:
            pass
        if self.overlap and plan:
            pass
        tokens = self._head() if self.shard.leads else []
"""
    found = "\n".join(_offences(old))
    for caught in (
        "['pager']",
        "tests a part for None",
        "['attention_on_device', 'placement']",
        "['overlap']",
        "['leads', 'shard']",
    ):
        assert caught in found
    assert "reads the collaborators ['pager']" in found


def _kinds(ops: object) -> list[tuple[str, int, int]]:
    return [(o.kind, o.layer, o.micro_batch) for o in ops]  # type: ignore[attr-defined]


def test_the_orders_carry_the_expert_pages_as_the_runner_issued_them() -> None:
    """Layer l takes its experts at its first post-attention (CGOPipe, attention in place) or before
    its first send (the baseline); page 0 of l + 1 then, page m + 1 after micro-batch m; l ends with
    its last micro-batch."""
    assert _kinds(local_steps(2, 2)) == [
        (BEGIN, 0, 0), (PREFETCH, 1, 0),
        (ATTEND, 0, 0), (PREFETCH, 1, 1), (ATTEND, 0, 1), (PREFETCH, 1, 2), (END, 0, 1),
        (BEGIN, 1, 0), (PREFETCH, 2, 0),
        (ATTEND, 1, 0), (PREFETCH, 2, 1), (ATTEND, 1, 1), (PREFETCH, 2, 2), (END, 1, 1),
    ]  # fmt: skip
    assert _kinds(sequential_steps(1, 2)) == [
        (BEGIN, 0, 0), (SEND, 0, 0), (RECEIVE, 0, 0), (PREFETCH, 1, 1),
        (SEND, 0, 1), (RECEIVE, 0, 1), (PREFETCH, 1, 2), (END, 0, 1),
    ]  # fmt: skip
    ops = _kinds(cgopipe_steps(2, 3, 2))
    assert [o for o in ops if o[0] in (SEND, RECEIVE)] == _kinds(cgopipe_order(2, 3, 2))  # CGOPipe's, unchanged
    for layer in range(2):
        first = ops.index((RECEIVE, layer, 0))
        assert ops[first - 2 : first] == [(BEGIN, layer, 0), (PREFETCH, layer + 1, 0)]
        assert ops[ops.index((RECEIVE, layer, 2)) + 1 :][:2] == [(PREFETCH, layer + 1, 3), (END, layer, 2)]
    assert ops.index((SEND, 1, 0)) < ops.index((BEGIN, 1, 0))  # the next layer's sends run ahead of its pages


@pytest.fixture(scope="module")
def bare(tiny_model: Path) -> ExpertRunner:
    """A runner with no collaborator at all: every part is its null one."""
    spec = ModelSpec.from_pretrained(tiny_model)
    layout = ArenaLayout.for_spec(spec, "float32")
    arena = torch.empty(layout.total_bytes, dtype=torch.uint8)
    fill_arena(arena, layout, tiny_model, spec, progress=False)
    return ExpertRunner(spec, weights_from_arena(arena, layout, spec), torch.device("cpu"), None)


def _plan(placement: Placement) -> StepPlan:
    return StepPlan(1, [[SequenceWork(0, [5, 7], 0, SamplingParams())]], StepKind.PREFILL, placement=placement)


def test_a_runner_without_collaborators_refuses_what_needs_them(bare: ExpertRunner) -> None:
    with pytest.raises(RuntimeError, match="only rank 0 connects"):
        bare.connect("nowhere", session=1)
    with pytest.raises(NotReadyError):
        bare.step(_plan(Placement()))
    with pytest.raises(ServiceError, match="--device-kv-memory") as info:
        bare.step(_plan(Placement(attention=Side.DEVICE)))
    assert info.value.code == grpc.StatusCode.FAILED_PRECONDITION
