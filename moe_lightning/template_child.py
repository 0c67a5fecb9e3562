"""A chat-template renderer process: the child side of moe_lightning/template_renderer.py, which
starts it, feeds it conversations and kills it. It compiles the template once under an address-space
limit, then renders one conversation per frame and replies with the text or the client's error. The
wire format is described in template_renderer.py; its constants live here, where the child, which
must import as little as it can, reads them.
"""

from __future__ import annotations

import marshal
import os
import struct
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from moe_lightning.chat_template import (
    ChatMessage,
    ChatTemplate,
    ChatTemplateError,
    ToolCall,
    ToolSpec,
    check_template_kwargs,
)

MAX_ERROR_CHARS = 2000  # an error's text (a template's raise_exception may quote the whole conversation)
REPLY_OK, REPLY_ERROR = 0, 1
REPLY_HEAD = struct.Struct(">BI")
FRAME_HEAD = struct.Struct(">I")


def encode_render(
    messages: Sequence[ChatMessage],
    add_generation_prompt: bool,
    tools: Sequence[ToolSpec] | None,
    template_kwargs: Mapping[str, Any] | None,
) -> tuple[Any, ...]:
    """One render's frame, of what marshal writes: each message as (role, content, tool calls as
    (id, name, arguments) tuples, tool_call_id, reasoning_content), the tools as (name, description,
    parameters) or None, and the kwargs as the plain JSON values check_template_kwargs makes of them
    (in the parent: a refused one never reaches a child, and marshal meets no other type)."""
    encoded = tuple(
        (
            m.role,
            m.content,
            tuple((c.id, c.name, c.arguments) for c in m.tool_calls),
            m.tool_call_id,
            m.reasoning_content,
        )
        for m in messages
    )
    specs = None if tools is None else tuple((t.name, t.description, t.parameters) for t in tools)
    return encoded, bool(add_generation_prompt), specs, check_template_kwargs(template_kwargs)


def decode_render(frame: tuple[Any, ...]) -> tuple[list[ChatMessage], bool, list[ToolSpec] | None, dict[str, Any]]:
    """encode_render's frame back to domain objects (checked again as they are built)."""
    encoded, add_generation_prompt, specs, kwargs = frame
    messages = [
        ChatMessage(role, content, tuple(ToolCall(*c) for c in calls), call_id, reasoning)
        for role, content, calls, call_id, reasoning in encoded
    ]
    tools = None if specs is None else [ToolSpec(*t) for t in specs]
    return messages, add_generation_prompt, tools, kwargs


def _read_frame(inp: int) -> bytes | None:
    def exactly(n: int) -> bytes | None:
        buf = bytearray()
        while len(buf) < n:
            chunk = os.read(inp, n - len(buf))
            if not chunk:
                return None  # the server closed the pipe (or died): this process ends
            buf += chunk
        return bytes(buf)

    head = exactly(FRAME_HEAD.size)
    return None if head is None else exactly(FRAME_HEAD.unpack(head)[0])


def _limit_memory(budget: int) -> None:
    """RLIMIT_AS at what this process maps now plus `budget`: a render that allocates past it gets a
    MemoryError (reported to the client), not the host's memory."""
    try:
        import resource

        with open("/proc/self/statm") as f:
            mapped = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
        resource.setrlimit(resource.RLIMIT_AS, (mapped + budget, mapped + budget))
    except (ImportError, OSError, ValueError):
        pass  # not Linux: the time limit still stands


def _child() -> None:
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # ^C in a terminal is the server's to handle (it kills us)
    reply_fd = os.dup(1)
    os.dup2(2, 1)  # anything printed goes to the server's log, never into a reply
    sys.stdout = sys.stderr

    def reply(status: int, text: str) -> None:
        data = text.encode("utf-8", "surrogatepass")
        out = memoryview(REPLY_HEAD.pack(status, len(data)) + data)
        while out:
            out = out[os.write(reply_fd, out) :]

    frame = _read_frame(0)
    if frame is None:
        return
    source, bos, eos, max_bytes, memory_bytes, tool_source = marshal.loads(frame)
    _limit_memory(memory_bytes)
    try:
        template = ChatTemplate(source, bos_token=bos, eos_token=eos, origin="chat template", tool_source=tool_source)
        template.compile()  # under the limit: compiling evaluates the template's constant expressions
    except ChatTemplateError as exc:  # an error only the compiler finds; the server names the template
        return reply(REPLY_ERROR, str(exc).removeprefix("chat template: "))
    except Exception as exc:  # MemoryError, RecursionError: the template's, reported at start-up
        message = f"the chat template cannot be compiled: {type(exc).__name__}: {exc}"
        return reply(REPLY_ERROR, message[:MAX_ERROR_CHARS])
    reply(REPLY_OK, "")
    while (frame := _read_frame(0)) is not None:
        try:
            messages, add_generation_prompt, tools, kwargs = decode_render(marshal.loads(frame))
            text = template.render(messages, add_generation_prompt, max_bytes, tools=tools, template_kwargs=kwargs)
        except ChatTemplateError as exc:
            message = str(exc)
            if len(message) > MAX_ERROR_CHARS:
                message = message[:MAX_ERROR_CHARS] + "..."
            reply(REPLY_ERROR, message)
            continue
        reply(REPLY_OK, text)


if __name__ == "__main__":
    _child()
