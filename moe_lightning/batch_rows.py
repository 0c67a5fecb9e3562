"""The rows of a batch job's input as Prompts, and the result columns its output gets: shared by the
single-box `run` (commands/run_job.py) and the `run --ray` driver and nodes (cluster/), which, being
the library, must not import a command module."""

from __future__ import annotations

import math
from typing import Any

from moe_lightning.config.job import RowDefaults

INT32 = (-(2**31), 2**31 - 1)  # max_new_tokens, top_k and token ids are int32 fields of GenerationInput
UINT64 = (0, 2**64 - 1)  # the seed


class RowError(ValueError):
    """A field of an input row that is not what it must be; the message names the row."""


def _as_int(value: Any, name: str, i: int, bounds: tuple[int, int] = INT32) -> int:
    # exact conversions only: int("abc") would raise without naming the row, int(2.5) or
    # bool("false") would silently run another job than the one asked for
    if isinstance(value, bool):
        raise RowError(f"row {i}: {name} must be an integer, got {value!r}")
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    elif isinstance(value, str):
        try:
            value = int(value.strip())
        except ValueError:
            raise RowError(f"row {i}: {name} must be an integer, got {value!r}") from None
    if not isinstance(value, int):
        raise RowError(f"row {i}: {name} must be an integer, got {value!r}")
    if not bounds[0] <= value <= bounds[1]:
        raise RowError(f"row {i}: {name} {value} is out of range [{bounds[0]}, {bounds[1]}]")
    return value


def _as_float(value: Any, name: str, i: int) -> float:
    if not isinstance(value, bool) and isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value.strip())
        except ValueError:
            pass
    raise RowError(f"row {i}: {name} must be a number, got {value!r}")


def _as_bool(value: Any, name: str, i: int) -> bool:
    if isinstance(value, bool) or (isinstance(value, int) and value in (0, 1)):
        return bool(value)
    raise RowError(f"row {i}: {name} must be true or false, got {value!r}")


def _as_stop(value: Any, i: int) -> list[str]:
    if isinstance(value, str):  # one stop string, as the OpenAI API takes it (list() would split it into letters)
        return [value]
    if isinstance(value, (list, tuple)) and all(isinstance(s, str) for s in value):
        return list(value)
    raise RowError(f"row {i}: stop must be a string or a list of strings, got {value!r}")


def _as_token_ids(ids: Any, i: int) -> list[int]:
    # a token id given as text ("12") is refused, not converted: a list of strings is most likely
    # a prompt split by mistake
    if not isinstance(ids, (list, tuple)):
        raise RowError(f"row {i}: prompt_ids must be a list of integers, got {ids!r}")
    for t in ids:
        if isinstance(t, str):
            raise RowError(f"row {i}: prompt_ids must be a list of integers, got {t!r} in it")
    return [_as_int(t, "prompt_ids", i) for t in ids]


def row_prompt(row: dict[str, Any], defaults: RowDefaults, i: int) -> Any:
    """Row `i` of the input as a Prompt: its own fields where it has them, else the flags'. A field of
    the wrong type is a RowError naming the row and the value, before anything is generated."""
    from moe_lightning.client import Prompt

    def pick(name: str) -> Any:
        value = row.get(name)
        if value is None or (isinstance(value, float) and math.isnan(value)):
            return getattr(defaults, name)
        return value

    text, ids = row.get("prompt"), row.get("prompt_ids")
    if text is None and ids is None:
        raise RowError(f"row {i} has neither prompt nor prompt_ids")
    token_ids = _as_token_ids(ids, i) if ids is not None else None
    if token_ids is None and not isinstance(text, str):
        raise RowError(f"row {i}: prompt must be a string, got {text!r}")
    seed = pick("seed")
    return Prompt(
        text=text if token_ids is None else None,
        token_ids=token_ids,
        max_new_tokens=_as_int(pick("max_new_tokens"), "max_new_tokens", i),
        temperature=_as_float(pick("temperature"), "temperature", i),
        top_k=_as_int(pick("top_k"), "top_k", i),
        top_p=_as_float(pick("top_p"), "top_p", i),
        seed=None if seed is None else _as_int(seed, "seed", i, UINT64),
        stop=_as_stop(pick("stop") or [], i),
        ignore_eos=_as_bool(pick("ignore_eos"), "ignore_eos", i),
        request_id=f"row-{i}",
    )


def completion_columns(done: list[Any]) -> dict[str, Any]:
    """The result columns every output row gets (single box and Ray parts alike)."""
    import pyarrow as pa

    return {
        "token_ids": pa.array([r.token_ids for r in done], type=pa.list_(pa.int32())),
        "text": [r.text for r in done],
        "finish_reason": [r.finish_reason for r in done],
        "prompt_tokens": pa.array([r.prompt_tokens for r in done], type=pa.int32()),
        "completion_tokens": pa.array([r.completion_tokens for r in done], type=pa.int32()),
        "latency_seconds": [r.total_seconds for r in done],
        "time_to_first_token_seconds": [r.time_to_first_token_seconds for r in done],
    }
