"""Chat templates rendered in child processes the server can kill.

A chat template is the checkpoint's code, downloaded with it. The sandbox keeps it from the
server's objects, but not from its time or memory: a Python thread cannot be stopped, and a loop of
loops emits nothing for minutes, `'x'.center(10**9)` is one C call. So the orchestrator renders in
a few long-lived processes of this module, each with the template compiled once and an address-space
limit (RLIMIT_AS) over what it had at start: a render past the time limit is killed (SIGKILL) and its
process replaced, as is one whose request was cancelled; its output is streamed in the child and cut
at the size bound (moe_lightning.chat_template), so no oversized text ever reaches the server.

A render costs a pipe round trip (marshal in, UTF-8 out: well under a millisecond on a normal
conversation). The processes die with the server: they are forked from the one spawner thread with
the parent-death signal armed (moe_lightning.children), and killed by close() at shutdown.

The child's side is moe_lightning/template_child.py. Wire format, parent to child: frames of a
4-byte big-endian length and a marshal payload, the first
(source, bos_token, eos_token, max_bytes, memory_bytes, tool_source), then per render
(messages, add_generation_prompt, tools, template_kwargs) as template_child.encode_render writes it
(plain tuples of strings, and the kwargs already checked to be JSON values: check_template_kwargs).
Child to parent: a status byte, a 4-byte length and UTF-8 bytes (the text, or the error for the
client). The parent never unmarshals what a child sends.
"""

from __future__ import annotations

import marshal
import math
import os
import queue
import select
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from moe_lightning.chat_template import ChatMessage, ChatTemplate, ChatTemplateError, ToolSpec
from moe_lightning.config.orchestrator import CHAT_TEMPLATE_TIMEOUT
from moe_lightning.template_child import FRAME_HEAD, MAX_ERROR_CHARS, REPLY_HEAD, REPLY_OK, encode_render

RENDERERS = 2  # processes; each render takes about a millisecond, so two serve thousands a second
DEFAULT_TIMEOUT = CHAT_TEMPLATE_TIMEOUT  # seconds a render may take (--chat-template-timeout)
START_TIMEOUT = 30.0  # a renderer's start: an interpreter, jinja2, the compile (a loaded host is slow)
MIN_MEMORY_BYTES = 256 << 20  # a render's address space over the child's own at start, at least
MEMORY_PER_OUTPUT_BYTE = 32  # ... and for large prompt bounds, this many times the output bound
CANCEL_POLL_SECONDS = 0.05  # how soon a cancelled request's render is noticed
PROBE = (ChatMessage("user", "Hello"),)  # rendered at start: a template that fails on it fails every chat
# The environment a renderer gets: what the interpreter and strftime_now need. Defense in depth only:
# a template that got out of the sandbox would not find the server's secrets (MOE_LIGHTNING_AUTH_TOKEN
# and the like) in its own os.environ, but it runs as the server's user, so it could read whatever that
# user can: the server's /proc/<pid>/environ and command line, the --tls-key file. Keeping those from
# it would take another user (or namespaces); the jinja sandbox is the boundary
CHILD_ENV = ("PATH", "PYTHONPATH", "LANG", "LANGUAGE", "TZ")
# why a render's renderer was killed (on_killed; moe_lightning_chat_template_renders_killed_total). A
# MemoryError is none of them: the renderer reports it and serves on (RLIMIT_AS fails the allocation)
KILL_REASONS = ("timeout", "cancelled", "crashed")


class _TimedOut(Exception):
    pass


class _Cancelled(Exception):
    pass


class _Died(Exception):
    pass


def memory_budget(max_bytes: int) -> int:
    """The address space a render may add to a renderer's own: room for the conversation and its text
    many times over, never so much that a template's memory bomb costs the host."""
    return max(MIN_MEMORY_BYTES, MEMORY_PER_OUTPUT_BYTE * max_bytes)


class _Worker:
    """One renderer process and its pipes; used by one thread at a time."""

    def __init__(self, proc: subprocess.Popen[bytes]) -> None:
        assert proc.stdin is not None and proc.stdout is not None
        self.proc = proc
        self._in, self._out = proc.stdin.fileno(), proc.stdout.fileno()
        self._poll = select.poll()
        self._poll.register(self._out, select.POLLIN)

    def send(self, payload: bytes) -> None:
        data = memoryview(FRAME_HEAD.pack(len(payload)) + payload)
        try:
            while data:  # the child reads while it waits, so a frame over the pipe's buffer only waits for it
                data = data[os.write(self._in, data) :]
        except OSError as exc:  # EPIPE: it died while idle
            raise _Died(str(exc)) from None

    def receive(self, deadline: float, cancel: threading.Event | None, max_len: int) -> tuple[int, bytes]:
        status, n = REPLY_HEAD.unpack(self._read(REPLY_HEAD.size, deadline, cancel))
        if n > max_len:
            raise _Died(f"a reply of {n} bytes")  # not what our child sends: treat it as broken
        return status, self._read(n, deadline, cancel)

    def _read(self, n: int, deadline: float, cancel: threading.Event | None) -> bytes:
        buf = bytearray()
        while len(buf) < n:
            self._wait(deadline, cancel)
            chunk = os.read(self._out, n - len(buf))
            if not chunk:
                raise _Died(f"exit code {self.proc.poll()}")
            buf += chunk
        return bytes(buf)

    def _wait(self, deadline: float, cancel: threading.Event | None) -> None:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise _TimedOut
            if cancel is not None and cancel.is_set():
                raise _Cancelled
            step = left if cancel is None else min(left, CANCEL_POLL_SECONDS)
            if self._poll.poll(max(1, int(step * 1000))):  # data, or the child's end (read then gives b"")
                return

    def signal(self) -> None:
        """SIGKILL only: a render stuck in one C call ends now, and the thread reading its pipe sees the
        end (its pipes are that thread's to close: closed under it, their numbers could be reused)."""
        self.proc.kill()  # a no-op once it was reaped

    def kill(self) -> None:
        """Kills, reaps and closes; by the thread using it, or for an idle one."""
        self.proc.kill()
        self.proc.wait()
        for pipe in (self.proc.stdin, self.proc.stdout):
            if pipe is not None:
                try:
                    pipe.close()
                except OSError:
                    pass


class TemplateRenderer:
    """`processes` renderers of `template`, each render bounded by `timeout` seconds and `max_bytes`
    bytes of text. render() is called from worker threads (at most `processes` at once is what keeps
    them from waiting: the API grants that many render slots); start() first, close() at shutdown.
    `on_killed(reason)`, one of KILL_REASONS, for each render whose renderer was killed or died (the
    server counts them); called on the rendering thread, so it must be quick and must not raise."""

    def __init__(
        self,
        template: ChatTemplate,
        *,
        max_bytes: int,
        timeout: float = DEFAULT_TIMEOUT,
        processes: int = RENDERERS,
        memory_bytes: int | None = None,
        start_timeout: float = START_TIMEOUT,
        on_killed: Callable[[str], None] | None = None,
    ) -> None:
        if not (timeout > 0 and math.isfinite(timeout)):  # the server refuses such a flag as it parses it
            raise ValueError(f"the chat template time limit must be positive (--chat-template-timeout): {timeout}")
        if processes < 1:
            raise ValueError(f"a chat template renderer needs at least one process, got {processes}")
        self.template, self.max_bytes, self.timeout, self.processes = template, max_bytes, timeout, processes
        self.memory_bytes = memory_budget(max_bytes) if memory_bytes is None else memory_bytes
        self.start_timeout = start_timeout
        self._on_killed = on_killed
        self._idle: queue.Queue[_Worker | None] = queue.Queue()
        self._all: set[_Worker] = set()
        self._lock = threading.Lock()
        self._closed = False
        import structlog  # the parent's log; the children never log

        self._log = structlog.get_logger()

    # ---- life ----------------------------------------------------------------------------------
    def start(self) -> None:
        """Starts the renderers and renders a one-message conversation: a template that cannot be
        compiled, or fails or times out on that, raises ChatTemplateError naming the template file
        (start-up fails, rather than every chat request). Closes what it started if it fails."""
        try:
            workers = [self._spawn() for _ in range(self.processes)]  # they start side by side
            for w in workers:
                self._ready(w)
                self._idle.put(w)
            try:
                self.render(PROBE)
            except ChatTemplateError as exc:
                raise ChatTemplateError(
                    f"{self.template.origin}: the chat template fails on a one-message conversation "
                    f"([{{'role': 'user', 'content': 'Hello'}}]), so it would fail every chat: {exc}"
                ) from None
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Kills every renderer, busy or not (a render waiting on one gets an error at once); idempotent."""
        with self._lock:
            self._closed = True
            workers, self._all = list(self._all), set()
        for w in workers:
            w.signal()
        # the idle ones are reaped here; a busy one by its thread, which now gets an error (_discard) or,
        # had its reply come just before, hands it back to be reaped (_give_back)
        while True:
            try:
                idle = self._idle.get_nowait()
            except queue.Empty:
                break
            if idle is not None:
                idle.kill()
        self._idle.put(None)  # wakes a thread waiting for a renderer (it passes the None on)

    def pids(self) -> list[int]:
        with self._lock:
            return [w.proc.pid for w in self._all]

    @property
    def closed(self) -> bool:
        with self._lock:
            return self._closed

    def _spawn(self) -> _Worker:
        from moe_lightning.children import spawner, with_parent_death

        argv = with_parent_death([sys.executable, "-m", "moe_lightning.template_child"])
        # forked from the one long-lived spawner thread: the parent-death signal follows the forking
        # thread, and a replacement is started from a short-lived one
        env = {k: v for k, v in os.environ.items() if k in CHILD_ENV or k.startswith("LC_")}
        # this very package, wherever it was imported from (a checkout run in place, not installed)
        root = str(Path(__file__).resolve().parents[1])
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
        proc = spawner.run(
            lambda: subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, cwd="/")
        )
        w = _Worker(proc)
        with self._lock:
            closed = self._closed
            if not closed:
                self._all.add(w)
        if closed:
            w.kill()
            raise _Died("closed")
        t = self.template
        try:
            w.send(
                marshal.dumps((t.source, t.bos_token, t.eos_token, self.max_bytes, self.memory_bytes, t.tool_source))
            )
        except _Died:
            self._discard(w, replace=False)
            raise
        return w

    def _ready(self, w: _Worker) -> None:
        try:
            status, data = w.receive(time.monotonic() + self.start_timeout, None, 1 << 20)
        except (_TimedOut, _Died) as exc:
            self._discard(w, replace=False)
            what = f"did not start within {self.start_timeout:g} s" if isinstance(exc, _TimedOut) else f"died ({exc})"
            raise ChatTemplateError(f"{self.template.origin}: a chat template renderer {what}") from None
        if status != REPLY_OK:
            self._discard(w, replace=False)
            raise ChatTemplateError(f"{self.template.origin}: {data.decode('utf-8', 'replace')}")

    def _discard(self, w: _Worker, replace: bool = True, killed: str | None = None) -> None:
        """Kills and reaps `w`; replaces it unless closed. `killed`: the render it was killed for (not
        counted once closed: close() killed it, not the render)."""
        with self._lock:
            self._all.discard(w)
            closed = self._closed
        w.kill()
        if killed is not None and not closed and self._on_killed is not None:
            self._on_killed(killed)
        if replace and not closed:
            threading.Thread(target=self._replace, name="chat-template-renderer-start", daemon=True).start()

    def _give_back(self, w: _Worker) -> None:
        """`w` back on the idle queue after a render, or, once closed, killed and reaped: close() drains
        the queue after it sets _closed (under the lock), so one put back after that would never be reaped."""
        with self._lock:
            closed = self._closed
            if not closed:
                self._idle.put(w)
        if closed:
            w.kill()  # close() signalled it; this reaps it and closes its pipes

    def _replace(self) -> None:
        delay = 0.5
        while True:
            try:
                w = self._spawn()
                self._ready(w)
            except (_Died, ChatTemplateError, OSError) as exc:  # cannot fork now (memory): try again, slower
                with self._lock:
                    if self._closed:
                        return
                self._log.error("chat_template_renderer_start_failed", error=str(exc), retry_seconds=delay)
                time.sleep(delay)
                delay = min(2 * delay, 10.0)
                continue
            with self._lock:  # close() drains the idle queue after it sets _closed: none is left behind
                closed = self._closed
                if not closed:
                    self._idle.put(w)
            if closed:
                w.kill()
            return

    def _take(self) -> _Worker:
        try:
            w = self._idle.get(timeout=self.start_timeout)  # only while one is being replaced
        except queue.Empty:
            from moe_lightning.service.errors import UnavailableError

            raise UnavailableError("no chat template renderer is running; retry shortly") from None
        if w is None:
            self._idle.put(None)
            from moe_lightning.service.errors import ShuttingDownError

            raise ShuttingDownError("the server is stopping")
        return w

    # ---- rendering -----------------------------------------------------------------------------
    def render(
        self,
        messages: Sequence[ChatMessage],
        add_generation_prompt: bool = True,
        cancel: threading.Event | None = None,
        *,
        tools: Sequence[ToolSpec] | None = None,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> str:
        """The template's text for `messages` (and `tools`, `template_kwargs`), as ChatTemplate.render
        gives it. ChatTemplateError (the client's: INVALID_ARGUMENT) when the template refuses or fails,
        passes `max_bytes`, or takes over `timeout`, or when `template_kwargs` are refused (checked here,
        before any renderer is taken); a set `cancel` (the client left) stops the render and kills its
        process."""
        if not messages:
            raise ChatTemplateError("a chat needs at least one message")
        payload = marshal.dumps(encode_render(messages, add_generation_prompt, tools, template_kwargs))
        for attempt in range(2):
            w = self._take()
            start = time.monotonic()
            try:
                w.send(payload)
                status, data = w.receive(start + self.timeout, cancel, self.max_bytes + 4 * MAX_ERROR_CHARS + 16)
            except _Died as exc:
                early = attempt == 0 and time.monotonic() - start < 0.1  # it was dead before this render began
                self._discard(w, killed=None if early else "crashed")
                if self.closed:
                    from moe_lightning.service.errors import ShuttingDownError

                    raise ShuttingDownError("the server is stopping") from None
                if early:
                    continue
                self._log.warning("chat_template_renderer_died", template=self.template.origin, error=str(exc))
                raise ChatTemplateError("the chat template's renderer crashed on this conversation") from None
            except _TimedOut:
                self._discard(w, killed="timeout")
                self._log.warning("chat_template_timeout", template=self.template.origin, seconds=self.timeout)
                raise ChatTemplateError(
                    f"the chat template took longer than {self.timeout:g} s to render this conversation"
                ) from None
            except _Cancelled:
                self._discard(w, killed="cancelled")
                raise ChatTemplateError("the request was cancelled while its chat was being rendered") from None
            except BaseException:  # the server's failure (an OSError on its pipe), not the render's: uncounted
                self._discard(w)
                raise
            self._give_back(w)
            text = data.decode("utf-8", "surrogatepass")
            if status == REPLY_OK:
                return text
            raise ChatTemplateError(text)
        raise AssertionError("unreachable")
