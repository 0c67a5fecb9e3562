"""The gateway's one GenerateStreams call (gateway/mux.py) across the orchestrator's faults and stops:
the streams open when the orchestrator dies end with its status and new ones run on a new call; an
idle call does not hold up the orchestrator's drain (docs/openai.md, "Overhead")."""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import openai

from moe_lightning.client import GenerationClient, Prompt
from moe_lightning.launcher import Stack

from processes import wait_serving


def client(stack: Stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.http_address}/v1", api_key="unused", max_retries=0)


def test_streams_through_an_orchestrator_that_died_end_and_new_ones_run(
    make_stack: Callable[..., Stack], tiny_model: Path
) -> None:
    s = make_stack(model=tiny_model, http_port=0)
    s.supervise()
    model = s.config.model.name
    body = {"model": model, "prompt": "x y", "max_tokens": 900, "stream": True, "ignore_eos": True}
    events = []
    with httpx.stream("POST", f"{s.http_address}/v1/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line[len("data: ") :])
            if len(events) == 3:
                os.kill(s.procs["orchestrator"].pid, signal.SIGKILL)
    # the open stream ended with the API's status as an error event, then [DONE]
    assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["code"] == "unavailable", events[-3:]
    wait_serving(s.api_address, 90)
    deadline = time.monotonic() + 30
    while httpx.get(f"{s.http_address}/health").status_code != 200:
        assert time.monotonic() < deadline, "the gateway does not see the restarted API"
        time.sleep(0.2)
    again = client(s).completions.create(model=model, prompt="The cat", max_tokens=6, temperature=0, stream=True)
    text = "".join(ch.choices[0].text for ch in again if ch.choices)
    assert text == _grpc_text(s)  # on a new streams call


def test_the_gateways_idle_streams_call_does_not_hold_up_the_orchestrators_drain(
    make_stack: Callable[..., Stack], tiny_model: Path
) -> None:
    s = make_stack(model=tiny_model, http_port=0)
    chunks = client(s).completions.create(model=s.config.model.name, prompt="x", max_tokens=3, stream=True)
    assert list(chunks)  # the gateway's GenerateStreams call is open, and idle now
    orchestrator = s.procs["orchestrator"]
    t0 = time.monotonic()
    orchestrator.send_signal(signal.SIGTERM)
    assert orchestrator.wait(timeout=20) == 0  # not the 30 s drain grace: the idle call ends at once
    assert time.monotonic() - t0 < 10


def _grpc_text(stack: Stack) -> str:
    with GenerationClient(stack.api_address, timeout=60) as c:
        return c.generate(Prompt(text="The cat", max_new_tokens=6)).text
