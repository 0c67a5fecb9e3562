"""`moe-lightning run` on OpenAI Batch files (as `vllm run-batch` takes them): one request per line,
`{"custom_id", "method": "POST", "url": "/v1/chat/completions" | "/v1/completions", "body"}`, and
one result per line, `{"id", "custom_id", "response": {"status_code", "request_id", "body"}, "error"}`,
in input order. The bodies are read and answered exactly as the HTTP gateway reads and answers them
(gateway/schema.py, gateway/responses.py); a bad line is that line's error, not the job's."""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
from pydantic import ValidationError

from gateway import responses
from gateway.errors import ApiError, bad_request, from_grpc
from gateway.schema import ChatCompletionRequest, CompletionRequest, UnsupportedField
from moe_lightning.api.generation.v1 import generation_pb2
from moe_lightning.output_files import output_file
from moe_lightning.reasoning import KEEPS_SPECIAL_TOKENS
from moe_lightning.validation import MAX_BATCH_PROMPTS

Input = generation_pb2.GenerationInput
ROUTES: dict[str, type[CompletionRequest] | type[ChatCompletionRequest]] = {
    "/v1/completions": CompletionRequest,
    "/v1/chat/completions": ChatCompletionRequest,
}


def is_openai_batch(path: Path) -> bool:
    """A .jsonl whose first line is a batch request (custom_id, url, body)."""
    if path.suffix not in (".jsonl", ".ndjson"):
        return False
    with path.open() as f:
        first = next((line for line in f if line.strip()), "")
    try:
        obj = json.loads(first)
    except json.JSONDecodeError:
        return False
    return isinstance(obj, dict) and {"custom_id", "url", "body"} <= set(obj)


@dataclass
class BatchLine:
    custom_id: str
    route: str = ""
    request: CompletionRequest | ChatCompletionRequest | None = None
    inputs: list[generation_pb2.GenerationInput] = field(default_factory=list)
    error: ApiError | None = None
    outputs: list[generation_pb2.GenerationOutput] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class OutputFormats:
    """How the server's model writes tool calls and reasoning (GetServerMetadata; "": not at all)."""

    tool_call_format: str = ""
    reasoning_format: str = ""


NO_FORMATS = OutputFormats()


def read_batch(path: Path, formats: OutputFormats = NO_FORMATS) -> list[BatchLine]:
    """`formats`: the server's (tool calls, reasoning), which chat lines with tools are read by."""
    lines = []
    with path.open() as f:
        for n, raw in enumerate(f, start=1):
            if raw.strip():
                lines.append(_parse(raw, n, formats.tool_call_format))
    if not lines:
        raise ValueError(f"{path}: no requests")
    return lines


def _parse(raw: str, n: int, tool_format: str = "") -> BatchLine:
    try:
        obj = json.loads(raw)
    except json.JSONDecodeError as exc:
        return BatchLine(f"line-{n}", error=bad_request(f"line {n} is not JSON: {exc}"))
    line = BatchLine(str(obj.get("custom_id", f"line-{n}")), str(obj.get("url", "")))
    if obj.get("method", "POST") != "POST" or line.route not in ROUTES:
        line.error = bad_request(f"url must be one of {sorted(ROUTES)} with method POST, got {line.route!r}", "url")
        return line
    try:
        line.request = ROUTES[line.route].model_validate(obj.get("body") or {})
        line.inputs = _inputs(line.request, tool_format)
    except ValidationError as exc:
        first = exc.errors()[0]
        param = ".".join(str(x) for x in first["loc"]) or None
        line.error = bad_request(f"{param or 'body'}: {first['msg']}", param)
    except UnsupportedField as exc:
        line.error = bad_request(str(exc), exc.param)
    return line


def with_formats(lines: list[BatchLine], formats: OutputFormats) -> None:
    """Reads the chat lines with tools again by the server's formats, known once it is reached (read_batch
    read them without: their error says the server parses no tool calls), and every chat line when the
    model's reasoning is written in special tokens (harmony's), which the output must keep."""
    keeps_special = formats.reasoning_format in KEEPS_SPECIAL_TOKENS  # harmony's channels are special tokens
    for line in lines:
        request = line.request
        if isinstance(request, ChatCompletionRequest) and (request.tools or (keeps_special and line.error is None)):
            line.error = None
            try:
                line.inputs = _inputs(request, formats.tool_call_format, formats.reasoning_format)
            except UnsupportedField as exc:
                line.error = bad_request(str(exc), exc.param)


def _inputs(
    request: CompletionRequest | ChatCompletionRequest, tool_format: str, reasoning_format: str = ""
) -> list[generation_pb2.GenerationInput]:
    if isinstance(request, ChatCompletionRequest):
        return request.inputs(tool_format=tool_format, reasoning_format=reasoning_format)
    return request.inputs()


def chunk_lines(lines: list[BatchLine], chunk_size: int, max_inputs: int) -> list[list[BatchLine]]:
    """At most `chunk_size` lines and `max_inputs` inputs (prompts x n) a chunk: a BatchGenerate over the
    server's max_batch_prompts is refused whole, and would then be retried line by line."""
    chunks: list[list[BatchLine]] = []
    size = 0
    for line in lines:
        if not chunks or len(chunks[-1]) >= chunk_size or size + len(line.inputs) > max_inputs:
            chunks.append([])
            size = 0
        chunks[-1].append(line)
        size += len(line.inputs)
    return chunks


def run_batch(
    lines: list[BatchLine],
    stub: Any,
    metadata: tuple[tuple[str, str], ...],
    chunk_size: int,
    in_flight: int,
    on_done: Callable[[int], None],
    max_inputs: int = MAX_BATCH_PROMPTS,
) -> None:
    """Every line's inputs through BatchGenerate, `chunk_size` lines per call and `in_flight` calls at
    once; a call the server refuses as a whole is retried line by line, so each line gets its own error."""
    todo = [line for line in lines if line.error is None]

    def one(chunk: list[BatchLine]) -> None:
        inputs = [m for line in chunk for m in line.inputs]
        try:
            outs = list(
                stub.BatchGenerate(generation_pb2.BatchGenerateRequest(inputs=inputs), metadata=metadata).outputs
            )
        except grpc.RpcError as exc:
            if len(chunk) > 1 and exc.code() == grpc.StatusCode.INVALID_ARGUMENT:  # whose? ask each line alone
                for line in chunk:
                    one([line])
                return
            for line in chunk:
                line.error = from_grpc(exc)  # type: ignore[arg-type]
            on_done(len(chunk))
            return
        for line in chunk:
            line.outputs, outs = outs[: len(line.inputs)], outs[len(line.inputs) :]
        on_done(len(chunk))

    chunks = chunk_lines(todo, chunk_size, max_inputs)
    with ThreadPoolExecutor(max_workers=max(1, in_flight)) as pool:
        list(pool.map(one, chunks))


def result_line(line: BatchLine, model: str, formats: OutputFormats = NO_FORMATS) -> dict[str, Any]:
    request_id = uuid.uuid4().hex
    if line.error is not None:
        response = {"status_code": line.error.status, "request_id": request_id, "body": line.error.body()}
    else:
        assert line.request is not None
        if isinstance(line.request, CompletionRequest):
            rid = responses.new_id("cmpl")
            body = line.request.response(rid, model, line.outputs)
        else:
            body = line.request.response(
                responses.new_id("chatcmpl"), model, line.outputs, formats.tool_call_format, formats.reasoning_format
            )
        response = {"status_code": 200, "request_id": request_id, "body": body}
    return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": line.custom_id, "response": response, "error": None}


def write_results(
    lines: list[BatchLine], model: str, path: Path, overwrite: bool = False, formats: OutputFormats = NO_FORMATS
) -> None:
    """The results file, written as every output of a job is (output_files.py: whole or not at all,
    never through a symbolic link or into another user's file; an own file only with `overwrite`)."""
    with output_file(path, overwrite) as f:
        for line in lines:
            f.write((json.dumps(result_line(line, model, formats), separators=(",", ":")) + "\n").encode())
