"""A route's JSON body, parsed and modelled here rather than by FastAPI: one over OFF_LOOP_BYTES on a
worker thread, where the event loop (every stream's events, /health) gets the GIL back between the
model's Python steps, and its lists counted before it is modelled (gateway/bounds.py). FastAPI parsed
and validated every body on the loop: four 8.3 MB bodies of 250,000 empty chat messages held it 5 s
(issue 54). Errors are FastAPI's own (RequestValidationError, in the app's handler's words)."""

from __future__ import annotations

import asyncio
import json
from email.message import Message
from typing import Any, TypeVar

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError

from gateway.errors import bad_request

OFF_LOOP_BYTES = 64 << 10  # below it a thread's hand-off (~0.1 ms) costs more than the parse
M = TypeVar("M", bound=BaseModel)


async def parse_body(request: Request, model: type[M]) -> M:
    """The request's body as `model` (_Guard has read it whole already: body() only joins it)."""
    raw = await request.body()
    content_type = request.headers.get("content-type")
    if len(raw) <= OFF_LOOP_BYTES:
        return modelled(raw, content_type, model)
    return await asyncio.to_thread(modelled, raw, content_type, model)


def _is_json(content_type: str | None) -> bool:
    """FastAPI's rule: application/json or application/*+json (no Content-Type is not JSON)."""
    if not content_type:
        return False
    message = Message()
    message["content-type"] = content_type
    subtype = message.get_content_subtype()
    return message.get_content_maintype() == "application" and (subtype == "json" or subtype.endswith("+json"))


def modelled(raw: bytes, content_type: str | None, model: type[M]) -> M:
    if not raw:
        raise RequestValidationError([{"type": "missing", "loc": ("body",), "msg": "Field required", "input": None}])
    if not _is_json(content_type):
        raise bad_request("the body must be JSON, sent with Content-Type: application/json")
    try:
        data: Any = json.loads(raw)
    except json.JSONDecodeError as exc:
        error = {"type": "json_invalid", "loc": ("body", exc.pos), "msg": "JSON decode error", "input": {}}
        raise RequestValidationError([{**error, "ctx": {"error": exc.msg}}]) from None
    except UnicodeDecodeError as exc:
        raise bad_request(f"the body is not valid UTF-8: {exc.reason} at byte {exc.start}") from None
    except RecursionError:
        raise bad_request("the body's JSON is nested too deeply") from None
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        errors = [{**e, "loc": ("body", *e["loc"])} for e in exc.errors(include_url=False)]
        raise RequestValidationError(errors) from None
    except RecursionError:
        raise bad_request("the body's JSON is nested too deeply") from None
