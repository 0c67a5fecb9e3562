"""The arena's layout without torch agrees with the torch dtypes its pages are viewed as."""

from __future__ import annotations

from moe_lightning.arena import PAGE_DTYPES
from moe_lightning.arena_layout import ITEMSIZE


def test_page_itemsizes_are_torchs() -> None:
    assert {name: dtype.itemsize for name, dtype in PAGE_DTYPES.items()} == ITEMSIZE
