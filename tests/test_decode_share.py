"""The share of a step's time charged to its decode rows (moe_lightning/hrm/decode_share.py): what the
HRM's mixed-step model says the decode pass alone would have cost, scaled to the measured step."""

from __future__ import annotations

import pytest

from moe_lightning.hrm.decode_share import decode_share
from moe_lightning.step_protocol import StepKind

MIXED = StepKind.MIXED


def test_a_decode_step_is_all_decode_and_a_prefill_none() -> None:
    assert decode_share(StepKind.DECODE, 64, 0, 5.0, 3.0, 1.0) == 1.0
    assert decode_share(StepKind.PREFILL, 0, 900, 5.0, 3.0, 1.0) == 0.0
    assert decode_share(MIXED, 0, 900, 5.0, 3.0, 1.0) == 0.0  # nothing decoded


def test_where_the_link_binds_prompt_tokens_in_its_slack_ride_free() -> None:
    # 64 decodes and 64 prompt tokens: the device's 30 of the link's 40 would be 15 for the decodes alone
    assert decode_share(MIXED, 64, 64, link=40.0, device=30.0, host=2.0) == 1.0
    # past the slack the prompt tokens cost: the step is the device's 60, the decodes alone the link's 40
    assert decode_share(MIXED, 64, 64, link=40.0, device=60.0, host=2.0) == pytest.approx(40 / 60)


def test_where_compute_binds_decoding_gets_its_rows_share() -> None:
    assert decode_share(MIXED, 16, 48, link=0.0, device=80.0, host=10.0) == pytest.approx(0.25)
    # on a CPU device the device's and the host's compute share the cores: one resource
    assert decode_share(MIXED, 16, 48, 0.0, 80.0, 10.0, shared_cores=True) == pytest.approx(0.25)
    assert decode_share(MIXED, 16, 48, 30.0, 20.0, 20.0, shared_cores=True) == pytest.approx(30 / 40)
    assert decode_share(MIXED, 16, 48, 30.0, 20.0, 20.0) == pytest.approx(1.0)  # apart, each under the link


def test_with_the_overlap_off_the_resources_add_up() -> None:
    # (b): the link, then the device and the host: the decodes keep the link and their share of the rest
    share = decode_share(MIXED, 32, 32, link=40.0, device=30.0, host=10.0, overlap=False)
    assert share == pytest.approx((40 + 0.5 * 40) / 80)
    assert decode_share(MIXED, 32, 0, 40.0, 30.0, 10.0, overlap=False) == 1.0  # no prompt tokens: all of it
