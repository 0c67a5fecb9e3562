"""Issue 27, items 3, 4 and 8, through a real orchestrator: a chat template is the checkpoint's code,
so its renders are bounded in time and size (a looping render is killed, a huge one cut, neither
holds up other requests nor health, and stop stays quick), a conversation is bounded in all before it
is rendered, token ids are counted before they are copied, and no error shows a server path."""

from __future__ import annotations

import os
import re
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest
from wire import token_ids_input, varint

from moe_lightning.api.generation.v1 import generation_pb2, generation_pb2_grpc
from moe_lightning.client import Prompt
from moe_lightning.demo_model import CHAT_TEMPLATE
from moe_lightning.launcher import Stack, StackError
from moe_lightning.service.names import GENERATION as API
from moe_lightning.service.upstream import health_status, open_channel

# The demo model's template, with branches that misbehave only for one message's content: the start-up
# probe (one user message, "Hello") renders normally, so the server serves
BRANCHES = {
    "loop": "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",  # minutes of nothing
    "huge": "{% for i in range(20000) %}{{ 'y' * 1000 }}{% endfor %}",  # 20 MB of text
    "undefined": "{{ nope.attr }}",
    "typeerror": "{{ 1 + 'a' }}",
}
TEMPLATE = CHAT_TEMPLATE + "".join(
    f"{{% if messages[0].content == '{word}' %}}{body}{{% endif %}}" for word, body in BRANCHES.items()
)
TIMEOUT = 2.0  # the default --chat-template-timeout
SERVING = 1


def chat(content: str) -> generation_pb2.GenerateRequest:
    return generation_pb2.GenerateRequest(input=Prompt(messages=[{"role": "user", "content": content}]).to_pb())


def call(stack: Stack, request: generation_pb2.GenerateRequest, timeout: float = 30) -> grpc.RpcError | None:
    ch = open_channel(stack.api_address)
    try:
        generation_pb2_grpc.GenerationStub(ch).Generate(request, timeout=timeout)
        return None
    except grpc.RpcError as exc:
        return exc
    finally:
        ch.close()


def killed(stack: Stack, reason: str) -> float:
    """moe_lightning_chat_template_renders_killed_total{reason} on the orchestrator's /metrics."""
    with urllib.request.urlopen(stack.endpoints()["orchestrator"]["metrics"], timeout=10) as r:
        text = r.read().decode()
    name = "moe_lightning_chat_template_renders_killed_total"
    found = re.search(rf'^{name}\{{reason="{reason}"\}} (\S+)$', text, re.M)
    assert found, f"{name}{{reason={reason!r}}} is not exported"
    return float(found[1])


def orchestrator_pid(stack: Stack) -> int:
    return stack.procs["orchestrator"].pid


def children(pid: int) -> list[int]:
    """The processes whose parent is `pid` (its renderers)."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(entry))
    return out


def cpu_ticks(pid: int) -> int:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # utime + stime


def rss_mib(pid: int, field: str = "VmRSS") -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise AssertionError(field)


def reset_peak(pid: int) -> None:
    Path(f"/proc/{pid}/clear_refs").write_text("5")  # VmHWM := VmRSS (Linux 4.0+)


class HealthProbe:
    """Health, every 50 ms on a channel of its own, while a test runs: the slowest answer, and every status."""

    def __init__(self, stack: Stack) -> None:
        self.ch = open_channel(stack.api_address)
        self.slowest, self.statuses = 0.0, set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run)

    def _run(self) -> None:
        while not self._stop.is_set():
            t = time.monotonic()
            try:
                self.statuses.add(health_status(self.ch, API, timeout=5))
            except grpc.RpcError as exc:
                self.statuses.add(str(exc.code()))
            self.slowest = max(self.slowest, time.monotonic() - t)
            time.sleep(0.05)

    def __enter__(self) -> HealthProbe:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.ch.close()


@pytest.fixture(scope="module")
def template_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("private-templates") / "bounded.jinja"
    path.write_text(TEMPLATE)
    return path


@pytest.fixture(scope="module")
def stack(make_module_stack: Callable[..., Stack], tiny_model: Path, template_file: Path) -> Stack:
    # the default --max-prefill-tokens (8192): text bound 64 KiB, receive limit 71 MB
    return make_module_stack(model=tiny_model, chat_template=template_file)


def test_a_looping_render_is_refused_at_its_time_limit_and_killed(stack: Stack) -> None:
    pid = orchestrator_pid(stack)
    before = set(children(pid))  # the renderers
    assert killed(stack, "timeout") == killed(stack, "cancelled") == killed(stack, "crashed") == 0
    t0 = time.monotonic()
    err = call(stack, chat("loop"))
    took = time.monotonic() - t0
    assert err is not None and err.code() == grpc.StatusCode.INVALID_ARGUMENT, err
    assert err.details() == f"the chat template took longer than {TIMEOUT:g} s to render this conversation"
    assert killed(stack, "timeout") == 1
    print(f"looping render refused in {took:.2f} s")
    assert TIMEOUT - 0.1 < took < TIMEOUT + 1.5
    assert len(before) == 2
    time.sleep(0.5)
    after = set(children(pid))
    assert len(before - after) == 1  # the looping one is gone (killed and reaped) ...
    deadline = time.monotonic() + 30
    while len(after) < 2 and time.monotonic() < deadline:  # ... and replaced
        time.sleep(0.1)
        after = set(children(pid))
    assert len(after) == 2
    ch = open_channel(stack.api_address)  # the replacement renders
    chat_ok = chat("Hello again")
    chat_ok.input.max_new_tokens = 3
    r = generation_pb2_grpc.GenerationStub(ch).Generate(chat_ok, timeout=30)
    ch.close()
    assert r.output.usage.prompt_tokens > 3 and r.output.usage.completion_tokens == 3
    time.sleep(1.0)  # the replacement's start (an interpreter, jinja2) is over
    ticks = {p: cpu_ticks(p) for p in after}
    time.sleep(1.0)
    # nothing burns CPU after the refusal (a looping render takes every tick of a core it gets: 100 a second)
    assert sum(cpu_ticks(p) - ticks[p] for p in after) < 20


def test_a_client_that_leaves_ends_its_render(stack: Stack) -> None:
    pid = orchestrator_pid(stack)
    before = set(children(pid))
    t0 = time.monotonic()
    err = call(stack, chat("loop"), timeout=0.5)  # the deadline passes mid-render: the server cancels the call
    assert err is not None and err.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    while before <= set(children(pid)) and time.monotonic() - t0 < TIMEOUT:
        time.sleep(0.05)
    # its renderer was killed when the call was cancelled, not at the render's time limit
    assert len(before) == 2 and not before <= set(children(pid)) and time.monotonic() - t0 < TIMEOUT - 0.5
    assert killed(stack, "cancelled") == 1


def test_looping_renders_hold_up_no_text_request_nor_health(stack: Stack) -> None:
    errors: list[grpc.RpcError | None] = []
    threads = [threading.Thread(target=lambda: errors.append(call(stack, chat("loop")))) for _ in range(8)]
    with HealthProbe(stack) as health:
        t0 = time.monotonic()
        for t in threads:
            t.start()
        time.sleep(0.3)
        ch = open_channel(stack.api_address)
        text = Prompt(text="Kabeno tisar molu", max_new_tokens=2).to_pb()
        generation_pb2_grpc.GenerationStub(ch).Generate(generation_pb2.GenerateRequest(input=text), timeout=10)
        ch.close()
        text_done = time.monotonic() - t0
        pending = sum(t.is_alive() for t in threads)
        for t in threads:
            t.join(60)
        all_done = time.monotonic() - t0
    print(f"text request done in {text_done:.2f} s beside 8 looping renders, all refused in {all_done:.2f} s")
    assert pending >= 6 and text_done < TIMEOUT  # served while the renders were pending
    assert health.statuses == {SERVING} and health.slowest < 1.0
    codes = [e.code() if e is not None else None for e in errors]
    # each render is killed at its limit, or (past the render slots) refused as busy while it waits
    assert len(codes) == 8 and set(codes) <= {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED}
    assert all_done < 4 * TIMEOUT + 3


def test_a_huge_render_is_cut_without_the_server_growing(stack: Stack) -> None:
    assert call(stack, chat("Hello")) is None  # a renderer is ready (those killed before are replaced)
    pid = orchestrator_pid(stack)
    rss = rss_mib(pid)
    reset_peak(pid)
    t0 = time.monotonic()
    err = call(stack, chat("huge"), timeout=60)
    took = time.monotonic() - t0
    assert err is not None and err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "rendered this conversation to more than 65536 bytes of text" in err.details()
    print(f"20 MB render refused in {took:.3f} s, orchestrator peak RSS +{rss_mib(pid, 'VmHWM') - rss:.1f} MiB")
    assert took < 1.0 and rss_mib(pid, "VmHWM") - rss < 50


def test_errors_name_no_server_path(stack: Stack, tiny_model: Path, template_file: Path) -> None:
    for content, words in (("undefined", "'nope' is undefined"), ("typeerror", "TypeError")):
        err = call(stack, chat(content))
        assert err is not None and err.code() == grpc.StatusCode.INVALID_ARGUMENT, err
        assert words in err.details()
        for path in (tiny_model, template_file, template_file.parent):
            assert str(path) not in err.details()
        assert "private-templates" not in err.details()


def test_a_long_conversation_is_refused_before_rendering(stack: Stack) -> None:
    # the case: 130 messages of 60 KB, each under the 64 KiB text bound, 7.8 MB in all
    messages = [{"role": "user" if i % 2 == 0 else "assistant", "content": "Kabeno " * 8570} for i in range(130)]
    request = generation_pb2.GenerateRequest(input=Prompt(messages=messages).to_pb())
    with HealthProbe(stack) as health:
        t0 = time.monotonic()
        err = call(stack, request)
        took = time.monotonic() - t0
    assert err is not None and err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "the conversation's messages are longer than any accepted prompt: at most 65536 bytes" in err.details()
    assert "--max-prefill-tokens" in err.details()
    print(f"130 x 60 KB conversation refused in {took:.3f} s, slowest health {health.slowest:.3f} s")
    assert took < 1.0 and health.statuses == {SERVING} and health.slowest < 1.0


def generate_with_ids(n: int) -> bytes:
    """A GenerateRequest of `n` token ids, on the wire."""
    generation_input = token_ids_input(n)
    return b"\x0a" + varint(len(generation_input)) + generation_input  # GenerateRequest.input


def test_26m_token_ids_are_refused_by_their_count(stack: Stack) -> None:
    pid = orchestrator_pid(stack)
    body = generate_with_ids(26_000_000)  # 26 MB, under the 71 MB receive limit
    ch = open_channel(stack.api_address)
    generate = ch.unary_unary(
        "/moe_lightning.api.generation.v1.Generation/Generate",
        request_serializer=None,
        response_deserializer=generation_pb2.GenerateResponse.FromString,
    )
    rss = rss_mib(pid)
    reset_peak(pid)
    t0 = time.monotonic()
    with pytest.raises(grpc.RpcError) as info:
        generate(body, timeout=60)
    took = time.monotonic() - t0
    ch.close()
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details() == "prompt has 26000000 tokens; this server accepts at most 8192 (--max-prefill-tokens)"
    # what is left is gRPC's, before the handler runs: the 26 MB message and its parse (upb grows the ids'
    # array by doubling: 230 MB measured in process); copying them to a list as well was 640 MB. 0.5 s on
    # an idle machine, most of it the transfer and the parse; 3.2 s before
    print(f"26 M token ids refused in {took:.3f} s, orchestrator peak RSS +{rss_mib(pid, 'VmHWM') - rss:.0f} MiB")
    assert took < 2.0 and rss_mib(pid, "VmHWM") - rss < 350


def test_stop_is_quick_with_renders_in_flight(stack: Stack) -> None:  # last: it stops the module's stack
    threads = [threading.Thread(target=call, args=(stack, chat("loop"))) for _ in range(4)]
    for t in threads:
        t.start()
    time.sleep(0.5)
    pid = orchestrator_pid(stack)
    renderers = children(pid)
    t0 = time.monotonic()
    stack.stop()
    took = time.monotonic() - t0
    for t in threads:
        t.join(10)
    print(f"stack stopped in {took:.2f} s with 4 renders in flight")
    assert took < 10 and not any(t.is_alive() for t in threads)
    assert not [p for p in renderers if Path(f"/proc/{p}").exists()]


def test_a_template_that_fails_the_probe_fails_start_up(
    make_stack: Callable[..., Stack], tiny_model: Path, tmp_path: Path
) -> None:
    path = tmp_path / "refuses.jinja"
    path.write_text("{{ raise_exception('this template renders no conversation') }}")
    s = make_stack(model=tiny_model, chat_template=path, start=False)
    with pytest.raises(StackError, match="orchestrator exited with code 1") as info:
        s.start(timeout=120)
    message = str(info.value)
    assert f"{path}: the chat template fails on a one-message conversation" in message
    assert "this template renders no conversation" in message
