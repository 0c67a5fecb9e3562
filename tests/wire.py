"""Protobuf wire bytes built by hand, for tests that send a message too large to build as Python
objects first (26 M token ids as a list would cost the test seconds and gigabytes)."""

from __future__ import annotations


def varint(n: int) -> bytes:
    out = bytearray()
    while n > 0x7F:
        out.append(0x80 | (n & 0x7F))
        n >>= 7
    out.append(n)
    return bytes(out)


def token_ids_input(n: int, token: int = 1) -> bytes:
    """A GenerationInput whose prompt is `n` copies of `token` (< 128), as its wire bytes."""
    token_ids = b"\x0a" + varint(n) + bytes([token]) * n  # TokenIds.ids, packed
    return b"\x12" + varint(len(token_ids)) + token_ids  # GenerationInput.token_ids
