"""Issue 54, the API edge through a real stack (tiny model, real gateway): a sampling control that made
NaN probabilities is a 400 while the requests beside it finish; a prompt_logprobs request whose JSON
would be hundreds of MB is refused before any work; bodies of 250,000 messages are refused while
/health answers. Each checks /health (the gateway's and the API's) while it runs."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from moe_lightning.launcher import Stack
from moe_lightning.service.names import GENERATION as API
from moe_lightning.service.upstream import health_status, open_channel
from moe_lightning.validation import MAX_RESPONSE_LOGPROBS


@pytest.fixture(scope="module")
def stack(make_module_stack: Callable[..., Stack], tiny_model: Path) -> Stack:
    return make_module_stack(model=tiny_model, http_port=0, max_batch_size=32, kv_cache_memory="64MiB")


@pytest.fixture(scope="module")
def model_id(stack: Stack) -> str:
    return stack.config.model.name


class _Health:
    """GET /health every 50 ms from a thread: the slowest answer, and every status seen."""

    def __init__(self, url: str) -> None:
        self.url, self.slowest, self.statuses = url, 0.0, set[int]()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def _poll(self) -> None:
        with httpx.Client(timeout=30) as c:
            while not self._stop.wait(0.05):
                started = time.monotonic()
                self.statuses.add(c.get(f"{self.url}/health").status_code)
                self.slowest = max(self.slowest, time.monotonic() - started)


@contextmanager
def _health(stack: Stack) -> Iterator[_Health]:
    h = _Health(stack.http_address)
    h._thread.start()
    try:
        yield h
    finally:
        h._stop.set()
        h._thread.join(60)


def _serving(stack: Stack) -> bool:
    ch = open_channel(stack.api_address)
    try:
        return health_status(ch, API, timeout=5) == 1
    finally:
        ch.close()


def _error(r: httpx.Response, param: str | None) -> str:
    assert r.status_code == 400, (r.status_code, r.text[:500])
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param, error
    return str(error["message"])


def test_a_penalty_that_made_nan_is_a_400_beside_sampled_requests(stack: Stack, model_id: str) -> None:
    """H2: repetition_penalty 1e-45 with temperature 1 made +inf logits and NaN probabilities, and the
    step raised: every request in flight ended UNAVAILABLE. Now it is refused; the 16 finish."""
    url = f"{stack.http_address}/v1/completions"
    sampled = {"model": model_id, "max_tokens": 24, "temperature": 1.0, "ignore_eos": True}
    bad = {"model": model_id, "prompt": "hello", "max_tokens": 8, "temperature": 1, "repetition_penalty": 1e-45}
    with _health(stack) as health, futures.ThreadPoolExecutor(17) as pool, httpx.Client(timeout=120) as c:
        runs = [pool.submit(c.post, url, json={**sampled, "prompt": f"story {i}", "seed": i}) for i in range(16)]
        time.sleep(0.3)  # the 16 are in their steps
        refused = pool.submit(c.post, url, json=bad).result()
        answers = [f.result() for f in runs]
    assert "repetition_penalty must be in 0.01..2" in _error(refused, "repetition_penalty")
    assert [r.status_code for r in answers] == [200] * 16, [r.text[:200] for r in answers if r.status_code != 200]
    assert all(r.json()["usage"]["completion_tokens"] == 24 for r in answers)
    assert health.statuses == {200} and _serving(stack)


def test_prompt_logprobs_bounded_by_the_json_they_make(stack: Stack, model_id: str) -> None:
    """H4: 256 prompts of 1,023 ids with prompt_logprobs 20 (a 1.2 MB body) passed the 64 MiB message
    check at 60.5 MB and became 324 MB of JSON; the gateway grew to 3.6 GB and both health checks failed
    for 72 s. Now refused before any work, with the limit named, while /health answers."""
    prompts = [[(7 * i + j) % 500 + 1 for j in range(1023)] for i in range(256)]
    body = {"model": model_id, "prompt": prompts, "max_tokens": 1, "prompt_logprobs": 20}
    with _health(stack) as health:
        started = time.monotonic()
        r = httpx.post(f"{stack.http_address}/v1/completions", json=body, timeout=60)
        took = time.monotonic() - started
    message = _error(r, None)  # the orchestrator's refusal, once the prompts are token ids: no one field
    print(f"MEASURE prompt_logprobs 256 x 1023 x 20: refused in {took:.2f} s, /health at most {health.slowest:.3f} s")
    assert (
        f"at most {MAX_RESPONSE_LOGPROBS}" in message and "256 prompts would carry 5499648 log-probabilities" in message
    )
    assert took < 10 and health.slowest < 1.0 and health.statuses == {200}
    # within the bound it is served: 4 prompts of 1,023 positions, top 20
    r = httpx.post(f"{stack.http_address}/v1/completions", json={**body, "prompt": prompts[:4]}, timeout=120)
    assert r.status_code == 200 and [len(c["prompt_logprobs"]) for c in r.json()["choices"]] == [1023] * 4


def test_bodies_of_250000_messages_are_refused_while_health_answers(stack: Stack, model_id: str) -> None:
    """Four 8.3 MB bodies of 250,000 empty chat messages held the gateway's event loop (health 5 s, two
    probes failed): the message count was checked after every message was modelled."""
    content = json.dumps({"model": model_id, "messages": [{"role": "user", "content": ""}] * 250_000}).encode()
    assert len(content) > 8_200_000
    headers = {"content-type": "application/json"}
    url = f"{stack.http_address}/v1/chat/completions"
    with _health(stack) as health, futures.ThreadPoolExecutor(4) as pool:
        time.sleep(0.2)
        answers = list(pool.map(lambda _: httpx.post(url, content=content, headers=headers, timeout=60), range(4)))
        time.sleep(0.2)
    print(f"MEASURE 4 x 250,000 messages: /health at most {health.slowest:.3f} s")
    for r in answers:
        assert "at most 2048" in _error(r, "messages")
    assert health.statuses == {200} and health.slowest < 1.0
