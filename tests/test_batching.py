from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from moe_lightning.batching import balance


def test_paper_example_sorts_and_balances() -> None:
    lengths = [418, 12, 77, 30, 200, 5, 150, 90]
    groups = balance(lengths, 3)
    sums = sorted(sum(lengths[i] for i in g) for g in groups)
    assert sums == [282, 282, 418]  # the longest prompt alone; the rest split evenly
    assert balance([5, 6], 4) == [[1], [0]]  # never more groups than items


@given(st.lists(st.integers(1, 5000), min_size=1, max_size=200), st.integers(1, 32))
def test_every_request_once_and_groups_within_one_item_of_each_other(lengths: list[int], n: int) -> None:
    groups = balance(lengths, n)
    flat = sorted(i for g in groups for i in g)
    assert flat == list(range(len(lengths)))
    sums = [sum(lengths[i] for i in g) for g in groups]
    assert max(sums) - min(sums) <= max(lengths)  # greedy longest-first bound
    assert len(groups) == min(n, len(lengths))
