"""The value types of flags and environment variables: sizes, rates, devices, counts. Each raises
argparse.ArgumentTypeError with a message that says what is allowed."""

from __future__ import annotations

import argparse
import math
import re
from collections.abc import Callable
from dataclasses import dataclass

from moe_lightning.config.choices import AUTO, DEVICE_TYPES, QUANTIZE_FORMATS

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?i?b?)?\s*$", re.IGNORECASE)
_UNITS = {
    "": 1,
    "b": 1,
    "k": 1e3,
    "kb": 1e3,
    "m": 1e6,
    "mb": 1e6,
    "g": 1e9,
    "gb": 1e9,
    "t": 1e12,
    "tb": 1e12,
    "ki": 2**10,
    "kib": 2**10,
    "mi": 2**20,
    "mib": 2**20,
    "gi": 2**30,
    "gib": 2**30,
    "ti": 2**40,
    "tib": 2**40,
}
_DEVICE = re.compile(r"^(cpu|cuda)(:\d+)?$")


def format_size(n: float) -> str:
    """Bytes for people: 1.50 GiB, 300.0 MiB, 12.0 KiB."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}" if unit == "GiB" else f"{n / scale:.1f} {unit}"
    return f"{int(n)} B"


def parse_size(text: str | int) -> int:
    """'4GiB', '512MB', '1.5G', '1000' -> bytes."""
    m = _SIZE.match(str(text))
    if m is None or m[2].lower() not in _UNITS:
        raise argparse.ArgumentTypeError(f"expected a size like 4GiB, 512MB or 1000000, got {text!r}")
    return int(float(m[1]) * _UNITS[m[2].lower()])


@dataclass(frozen=True)
class DeviceShare:
    """`--device-memory 25%`: the dense weights plus this share of the expert pages (in the arena's
    format), so every format keeps the same experts on the device and streams the rest."""

    percent: float  # as given: argv carries it back bit for bit

    @property
    def fraction(self) -> float:
        return self.percent / 100

    def __str__(self) -> str:
        return f"{self.percent!r}%"


def parse_device_memory(text: str | int) -> int | DeviceShare:
    """A size ('16GiB') or a share of the weights ('25%', in (0%, 100%])."""
    raw = str(text).strip()
    if not raw.endswith("%"):
        return parse_size(raw)
    try:
        percent = float(raw.removesuffix("%"))
    except ValueError:
        percent = math.nan
    if not 0 < percent <= 100:
        raise argparse.ArgumentTypeError(
            f"expected a size like 16GiB or a share of the weights in (0%, 100%] like 25%, got {text!r}"
        )
    return DeviceShare(percent)


def parse_rate(text: str) -> float:
    """'2GB/s', '500MiB/s', '1.5e9', '2G' -> bytes per second (positive)."""
    raw = str(text).strip()
    body = raw[:-2] if raw.lower().endswith("/s") else raw
    try:
        rate = float(body)  # plain and scientific notation (1.5e9)
    except ValueError:
        try:
            rate = float(parse_size(body))
        except argparse.ArgumentTypeError:
            rate = -1.0
    if not rate > 0 or rate == float("inf"):
        raise argparse.ArgumentTypeError(
            f"expected a positive rate in bytes per second like 2GB/s, 500MiB/s or 1.5e9, got {text!r}"
        )
    return rate


def format_rate(rate: float) -> str:
    """Bytes per second for people: 1.50 GB/s, 300.0 MB/s (decimal units, as links are quoted)."""
    for unit, scale in (("GB/s", 1e9), ("MB/s", 1e6), ("kB/s", 1e3)):
        if rate >= scale:
            return f"{rate / scale:.2f} {unit}"
    return f"{rate:.0f} B/s"


def parse_device(text: str) -> str:
    """'cpu', 'cuda' or 'cuda:N' (torch's spelling; checked against what is visible when a service starts)."""
    value = str(text).strip()
    if not _DEVICE.match(value):
        raise argparse.ArgumentTypeError(f"expected {', '.join(DEVICE_TYPES)} or cuda:N, got {text!r}")
    return value


def at_least(least: int) -> Callable[[str], int]:
    """A parser of whole numbers of `least` or more."""

    def parse(value: str) -> int:
        try:
            n = int(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a whole number of {least} or more, got {value!r}") from None
        if n < least:
            raise argparse.ArgumentTypeError(f"must be {least} or more, got {n}")
        return n

    parse.__name__ = "int"
    return parse


positive_int = at_least(1)
non_negative_int = at_least(0)


def parse_expert_groups(text: str | int) -> int | None:
    """--expert-groups: 'auto' -> None (the HRM picks), else a whole number >= 0 (0: once per micro-batch)."""
    if str(text).strip().lower() == AUTO:
        return None
    try:
        return non_negative_int(str(text))
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(
            f"must be auto or a whole number of 0 or more (0: once per micro-batch), got {text!r}"
        ) from None


def positive(kind: type[int] | type[float]) -> Callable[[str], int | float]:
    """A parser of numbers > 0 of `kind`."""

    def parse(text: str) -> int | float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a number > 0, got {text!r}") from None
        if not value > 0:  # inf is allowed: no limit (a timeout of inf waits for good)
            raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
        return value

    parse.__name__ = kind.__name__  # argparse names the type in its message: "invalid int value"
    return parse


def parse_formats(text: str) -> tuple[str, ...]:
    """'none,int8,int4' -> the expert page formats in that order, each once."""
    formats = tuple(part.strip() for part in str(text).split(","))
    for part in formats:
        if part not in QUANTIZE_FORMATS:
            raise argparse.ArgumentTypeError(
                f"expected a comma-separated list of {', '.join(QUANTIZE_FORMATS)}, got {part!r}"
            )
    if len(set(formats)) != len(formats):
        raise argparse.ArgumentTypeError(f"lists a format twice: {text}")
    return formats
