"""The Step contract at the service edge: a plan's kind, placement and release list, and the typed
timings, survive protobuf both ways; an enum an older peer left unset is refused, not defaulted."""

from __future__ import annotations

import grpc
import pytest

from moe_lightning.api.gpu_expert.v1 import gpu_expert_pb2
from moe_lightning.placement import Placement, Side
from moe_lightning.sampling import SamplingParams, TokenLogprobs
from moe_lightning.service.convert import step_output_from_pb, step_output_to_pb, step_plan_from_pb, step_plan_to_pb
from moe_lightning.service.errors import ServiceError
from moe_lightning.step_protocol import SequenceWork, StepKind, StepOutput, StepPlan, StepTimings


@pytest.mark.parametrize("placement", [Placement(a, e) for a in Side for e in Side])
@pytest.mark.parametrize("kind", list(StepKind))
def test_a_plan_round_trips(placement: Placement, kind: StepKind) -> None:
    sampling = SamplingParams(0.5, 5, 0.75, 11, 2)  # exact in the proto's float32
    works = [[SequenceWork(7, [1, 2, 3], 0, sampling)], [SequenceWork(9, [4], 12)]]
    plan = StepPlan(3, works, kind, [1, 5], placement)
    assert step_plan_from_pb(step_plan_to_pb(plan)) == plan


def test_timings_and_tokens_round_trip() -> None:
    timings = StepTimings(StepKind.PREFILL, *range(1, 12))  # every stage, each its own value
    lp = TokenLogprobs(4, -0.5, [4, 2], [-0.5, -1.25])
    out = StepOutput([7, 9], [4, 8], timings, {9: lp})
    back = step_output_from_pb(step_output_to_pb(out))
    assert back == out and back.timings.kind is StepKind.PREFILL
    assert back.timings.stages()["handler"] == 9 and back.timings.stages()["attention_busy"] == 11


def test_unset_enums_are_refused() -> None:
    m = step_plan_to_pb(StepPlan(1, [[SequenceWork(1, [5], 0, SamplingParams())]], StepKind.DECODE))
    m.ClearField("kind")
    with pytest.raises(ServiceError, match="kind must be set") as info:
        step_plan_from_pb(m)
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    m = step_plan_to_pb(StepPlan(1, [], StepKind.DECODE))
    m.placement.attention = gpu_expert_pb2.SIDE_UNSPECIFIED
    with pytest.raises(ServiceError, match="placement.attention must be set"):
        step_plan_from_pb(m)
