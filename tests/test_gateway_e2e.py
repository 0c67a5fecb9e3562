"""The OpenAI-compatible gateway through a real stack, with real clients: the official `openai`
package (sync, async, streaming), `curl -N`, and plain HTTP for what the client hides (status
codes, error bodies, a client that leaves). Every answer is checked against the gRPC API's for the
same request (docs/openai.md)."""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import grpc
import httpx
import openai
import pytest

from moe_lightning.api.generation.v1 import generation_pb2, generation_pb2_grpc
from moe_lightning.client import GenerationClient, Prompt
from moe_lightning.launcher import Stack

from processes import cli

CHAT = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hello there"}]


@pytest.fixture(scope="module")
def stack(make_module_stack: Callable[..., Stack], tiny_model: Path) -> Stack:
    return make_module_stack(model=tiny_model, http_port=0, max_batch_size=64, kv_cache_memory="64MiB")


@pytest.fixture(scope="module")
def model_id(stack: Stack) -> str:
    return stack.config.model.name


def client(stack: Stack, **kw: object) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.http_address}/v1", api_key="unused", max_retries=0, **kw)  # type: ignore[arg-type]


def grpc_text(stack: Stack, **prompt: object) -> tuple[str, str]:
    with GenerationClient(stack.api_address, timeout=60) as c:
        done = c.generate(Prompt(**prompt))  # type: ignore[arg-type]
    return done.text, done.finish_reason


def test_models_and_health(stack: Stack, model_id: str) -> None:
    models = client(stack).models.list()
    assert [m.id for m in models.data] == [model_id]
    assert httpx.get(f"{stack.http_address}/health").json() == {"status": "ok"}
    metrics = httpx.get(f"{stack.http_address}/metrics").text
    assert "moe_lightning_gateway_requests_total" in metrics
    # a service's own gauges are not the gateway's: `moe_lightning_serving 0` there would page as a
    # service that is down (deploy/alerts), and the gateway imports the shared validation module
    assert "moe_lightning_serving" not in metrics and "moe_lightning_kv_cache_usage_ratio" not in metrics


def test_completions_equal_the_grpc_api(stack: Stack, model_id: str) -> None:
    c = client(stack)
    r = c.completions.create(model=model_id, prompt="Once upon a time", max_tokens=12, temperature=0)
    text, finish = grpc_text(stack, text="Once upon a time", max_new_tokens=12)
    assert r.object == "text_completion" and r.choices[0].text == text
    assert r.choices[0].finish_reason == {"length": "length", "eos": "stop", "stop": "stop"}[finish]
    assert r.usage.completion_tokens <= 12 and r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    # a list of prompts (strings and token ids) with n choices each, in OpenAI's order
    seeded = dict(prompt=["a b c", "d e"], n=2, max_tokens=5, temperature=0.8, seed=7, extra_body={"ignore_eos": True})
    r = c.completions.create(model=model_id, **seeded)  # type: ignore[call-overload]
    assert [ch.index for ch in r.choices] == [0, 1, 2, 3]
    again = c.completions.create(model=model_id, **seeded)  # type: ignore[call-overload]
    assert [ch.text for ch in r.choices] == [ch.text for ch in again.choices]  # seeded: reproducible
    assert (
        r.choices[0].text
        == grpc_text(stack, text="a b c", max_new_tokens=5, temperature=0.8, seed=7, ignore_eos=True)[0]
    )
    assert r.usage.completion_tokens == 20
    ids = c.completions.create(model=model_id, prompt=[1, 5, 9, 13], max_tokens=4, temperature=0)
    assert ids.choices[0].text == grpc_text(stack, token_ids=[1, 5, 9, 13], max_new_tokens=4)[0]


def test_streamed_completion_pieces_are_the_grpc_stream_pieces(stack: Stack, model_id: str) -> None:
    stream = client(stack).completions.create(
        model=model_id,
        prompt="The cat",
        max_tokens=20,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    pieces = [ch.choices[0].text for ch in chunks if ch.choices and ch.choices[0].text]
    with GenerationClient(stack.api_address, timeout=60) as g:
        grpc_pieces = [
            m.text
            for m in g.stream(Prompt(text="The cat", max_new_tokens=20))
            if getattr(m, "text", "") and not hasattr(m, "finish_reason")
        ]
    assert "".join(pieces) == "".join(grpc_pieces) == grpc_text(stack, text="The cat", max_new_tokens=20)[0]
    # a message per step on both hops; a reader that fell behind gets several steps' pieces in one
    # (orchestrator/api.py), so the two streams are equal when neither fell behind
    assert len(pieces) > 1 and (pieces == grpc_pieces or len(pieces) != len(grpc_pieces)), (pieces, grpc_pieces)
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 20 and not chunks[-1].choices
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason] == ["length"]


def test_streamed_choices_of_several_prompts_add_up_to_the_unstreamed_ones(stack: Stack, model_id: str) -> None:
    seeded = dict(prompt=["a b c", "d e"], n=2, max_tokens=6, temperature=0.8, seed=11, extra_body={"ignore_eos": True})
    c = client(stack)
    whole = c.completions.create(model=model_id, **seeded)  # type: ignore[call-overload]
    stream = c.completions.create(model=model_id, stream=True, stream_options={"include_usage": True}, **seeded)  # type: ignore[call-overload]
    texts, finishes = ["", "", "", ""], [[], [], [], []]
    usage = None
    for ch in stream:
        usage = ch.usage or usage
        for choice in ch.choices:
            texts[choice.index] += choice.text
            if choice.finish_reason:
                finishes[choice.index].append(choice.finish_reason)
    assert texts == [ch.text for ch in whole.choices]
    assert finishes == [["length"]] * 4  # one last chunk per choice
    assert usage is not None and usage.model_dump() == whole.usage.model_dump()


def test_a_streamed_request_the_api_refuses_gets_its_http_status(stack: Stack, model_id: str) -> None:
    body = {"model": model_id, "prompt": "x", "max_tokens": 10**6, "stream": True}
    r = httpx.post(f"{stack.http_address}/v1/completions", json=body, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_argument", r.text  # not a 200 stream
    with pytest.raises(openai.BadRequestError, match="context"):
        client(stack).chat.completions.create(model=model_id, messages=CHAT, max_tokens=10**6, stream=True)  # type: ignore[arg-type]


def test_chat_sync_async_and_streamed_agree_with_the_grpc_messages_form(stack: Stack, model_id: str) -> None:
    want, _ = grpc_text(stack, messages=CHAT, max_new_tokens=16)
    r = client(stack).chat.completions.create(model=model_id, messages=CHAT, max_tokens=16, temperature=0)  # type: ignore[arg-type]
    assert r.object == "chat.completion" and r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == want

    async def both() -> tuple[str, list[str]]:
        a = openai.AsyncOpenAI(base_url=f"{stack.http_address}/v1", api_key="unused", max_retries=0)
        one = await a.chat.completions.create(model=model_id, messages=CHAT, max_tokens=16, temperature=0)  # type: ignore[arg-type]
        stream = await a.chat.completions.create(
            model=model_id,
            messages=CHAT,
            max_tokens=16,
            temperature=0,
            stream=True,  # type: ignore[arg-type]
        )
        pieces = [ch.choices[0].delta.content or "" async for ch in stream if ch.choices]
        await a.close()
        return one.choices[0].message.content or "", pieces

    content, pieces = asyncio.run(both())
    assert content == want and "".join(pieces) == want
    parts = [{"role": "user", "content": [{"type": "text", "text": "Hello "}, {"type": "text", "text": "there"}]}]
    r = client(stack).chat.completions.create(model=model_id, messages=parts, max_tokens=8, temperature=0)  # type: ignore[arg-type]
    assert (
        r.choices[0].message.content
        == grpc_text(stack, messages=[{"role": "user", "content": "Hello \nthere"}], max_new_tokens=8)[0]
    )


def test_logprobs_in_each_apis_form(stack: Stack, model_id: str) -> None:
    c = client(stack)
    r = c.completions.create(model=model_id, prompt="Hello", max_tokens=4, temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    assert lp is not None and "".join(lp.tokens or []) == r.choices[0].text
    assert len(lp.top_logprobs or []) == 4 and all(len(t) <= 3 for t in lp.top_logprobs or [])
    assert lp.text_offset == [sum(len(t) for t in (lp.tokens or [])[:i]) for i in range(4)]
    chat = c.chat.completions.create(
        model=model_id,
        messages=CHAT,
        max_tokens=4,
        temperature=0,
        logprobs=True,
        top_logprobs=2,  # type: ignore[arg-type]
    )
    content = chat.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == 4 and all(len(t.top_logprobs) == 2 for t in content)
    assert all(t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob for t in content)


def test_echo_with_logprobs_scores_the_prompt_as_the_grpc_api_does(stack: Stack, model_id: str) -> None:
    c = client(stack)
    prompt = "Once upon a time"
    with GenerationClient(stack.api_address, timeout=60) as g:
        ref = g.generate(Prompt(text=prompt, max_new_tokens=3, prompt_logprobs=2, logprobs=2, echo=True))
    r = c.completions.create(model=model_id, prompt=prompt, max_tokens=3, temperature=0, logprobs=2, echo=True)
    choice = r.choices[0]
    assert choice.text == prompt + ref.text and ref.prompt_text == prompt
    lp = choice.logprobs
    assert lp is not None and lp.token_logprobs is not None and lp.top_logprobs is not None
    n = len(ref.prompt_logprobs) + 1
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # nothing predicts the first token
    assert lp.token_logprobs[1:n] == pytest.approx([e["logprob"] for e in ref.prompt_logprobs])
    assert lp.token_logprobs[n:] == pytest.approx([e["logprob"] for e in ref.logprobs])
    assert "".join(lp.tokens or []) == choice.text
    assert lp.text_offset == [sum(len(t) for t in (lp.tokens or [])[:i]) for i in range(len(lp.tokens or []))]
    # max_tokens 0 scores the prompt alone, as lm-eval's log-likelihood requests and OpenAI's legacy scoring do
    scored = c.completions.create(model=model_id, prompt=prompt, max_tokens=0, logprobs=1, echo=True)
    assert scored.choices[0].text == prompt and scored.usage is not None and scored.usage.completion_tokens == 0
    assert scored.choices[0].logprobs.token_logprobs == lp.token_logprobs[:n]  # type: ignore[union-attr]
    # vLLM's prompt_logprobs field: None for the first token, then {id: {logprob, decoded_token}}
    raw = httpx.post(
        f"{stack.http_address}/v1/completions",
        json={"model": model_id, "prompt": prompt, "max_tokens": 1, "prompt_logprobs": 0},
        timeout=60,
    ).json()
    entries = raw["choices"][0]["prompt_logprobs"]
    assert entries[0] is None and len(entries) == n
    assert [next(iter(e.values()))["logprob"] for e in entries[1:]] == pytest.approx(lp.token_logprobs[1:n])


def test_errors_have_openais_shape_and_status(stack: Stack, model_id: str) -> None:
    c = client(stack)
    with pytest.raises(openai.NotFoundError) as nf:
        c.completions.create(model="gpt-4", prompt="x")
    assert nf.value.body["code"] == "model_not_found" and nf.value.body["param"] == "model"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as bad:
        c.completions.create(model=model_id, prompt="x", temperature=-1)
    assert bad.value.body["param"] == "temperature"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError, match="echo is not supported with stream") as echo:
        c.completions.create(model=model_id, prompt="x", echo=True, stream=True)
    assert echo.value.body["param"] == "echo"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError, match="context"):  # the gRPC API's INVALID_ARGUMENT, as 400
        c.completions.create(model=model_id, prompt="x", max_tokens=10**6)
    with pytest.raises(openai.BadRequestError, match="only text content parts"):
        c.chat.completions.create(
            model=model_id,
            messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],  # type: ignore[list-item]
        )
    big = httpx.post(
        f"{stack.http_address}/v1/completions", content=b"x" * (9 << 20), headers={"content-type": "application/json"}
    )
    assert big.status_code == 413 and big.json()["error"]["type"] == "invalid_request_error"
    broken = httpx.post(
        f"{stack.http_address}/v1/completions", content=b"{not json", headers={"content-type": "application/json"}
    )
    assert broken.status_code == 400 and set(broken.json()["error"]) == {"message", "type", "param", "code"}


def test_curl_streams_server_sent_events_ending_in_done(stack: Stack, model_id: str) -> None:
    body = json.dumps({"model": model_id, "messages": CHAT, "max_tokens": 6, "stream": True})
    out = subprocess.run(
        [
            "curl",
            "-sS",
            "-N",
            f"{stack.http_address}/v1/chat/completions",
            "-H",
            "Content-Type: application/json",
            "-d",
            body,
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    events = [line[len("data: ") :] for line in out.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(ch["object"] == "chat.completion.chunk" for ch in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    text = "".join(ch["choices"][0]["delta"].get("content") or "" for ch in chunks if ch["choices"])
    assert text == grpc_text(stack, messages=CHAT, max_new_tokens=6)[0]


def _orchestrator_metric(stack: Stack, pattern: str) -> float:
    with urllib.request.urlopen(stack.endpoints()["orchestrator"]["metrics"], timeout=10) as r:
        found = re.search(pattern, r.read().decode(), re.M)
    return float(found[1]) if found else 0.0


def test_a_client_that_leaves_cancels_its_request(stack: Stack, model_id: str) -> None:
    cancelled = r'^moe_lightning_requests_total\{outcome="cancelled"\} (\S+)'
    before = _orchestrator_metric(stack, cancelled)
    body = {"model": model_id, "prompt": "x y", "max_tokens": 900, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", f"{stack.http_address}/v1/completions", json=body, timeout=60) as r:
        for n, _ in enumerate(r.iter_lines()):
            if n > 3:
                break  # leave mid-stream
    body["stream"] = False
    with pytest.raises(httpx.ReadTimeout):  # a non-streamed one too: the gateway sees the disconnect
        httpx.post(f"{stack.http_address}/v1/completions", json=body, timeout=1.0)
    deadline = time.monotonic() + 30
    while _orchestrator_metric(stack, cancelled) < before + 2:
        assert time.monotonic() < deadline, "the requests of clients that left were not cancelled"
        time.sleep(0.2)
    assert _orchestrator_metric(stack, r"^moe_lightning_requests_running (\S+)") == 0


def test_64_concurrent_streams_are_whole_and_distinct(stack: Stack, model_id: str) -> None:
    async def one(a: openai.AsyncOpenAI, i: int) -> tuple[str, str | None, int]:
        stream = await a.completions.create(
            model=model_id,
            prompt=f"story {i}",
            max_tokens=12,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        text, finish, chunks = "", None, 0
        async for ch in stream:
            chunks += 1
            text += ch.choices[0].text
            finish = ch.choices[0].finish_reason or finish
        return text, finish, chunks

    async def all_of_them() -> list[tuple[str, str | None, int]]:
        a = openai.AsyncOpenAI(base_url=f"{stack.http_address}/v1", api_key="unused", max_retries=0, timeout=120)
        try:
            return await asyncio.gather(*(one(a, i) for i in range(64)))
        finally:
            await a.close()

    try:
        results = asyncio.run(all_of_them())
        for i in (0, 17, 63):  # each stream is its own prompt's whole text, nothing lost or duplicated
            assert results[i][0] == grpc_text(stack, text=f"story {i}", max_new_tokens=12, ignore_eos=True)[0]
    except Exception as exc:  # once (1 run in ~30) this took 60 s more: say what the scheduler held then
        held = {q: _orchestrator_metric(stack, rf"^moe_lightning_requests_{q} (\S+)") for q in ("running", "waiting")}
        raise AssertionError(f"{exc!r}; the orchestrator then held {held}") from exc
    assert all(finish == "length" for _, finish, _ in results)


def test_a_token_is_required_when_the_stack_has_one(make_stack: Callable[..., Stack], tiny_model: Path) -> None:
    s = make_stack(model=tiny_model, http_port=0, auth_token="s3cret")
    model = s.config.model.name
    with pytest.raises(openai.AuthenticationError):
        client(s).completions.create(model=model, prompt="x", max_tokens=2)
    r = openai.OpenAI(base_url=f"{s.http_address}/v1", api_key="s3cret", max_retries=0).completions.create(
        model=model, prompt="x", max_tokens=2
    )
    assert r.usage.completion_tokens == 2
    chunks = openai.OpenAI(base_url=f"{s.http_address}/v1", api_key="s3cret", max_retries=0).completions.create(
        model=model, prompt="x", max_tokens=3, stream=True, extra_body={"ignore_eos": True}
    )
    assert sum(1 for ch in chunks if ch.choices and ch.choices[0].text) >= 1  # its streams call carries the token
    assert httpx.get(f"{s.http_address}/health").status_code == 200  # probes need no token
    with grpc.insecure_channel(s.api_address) as ch:  # and the API's streams call refuses a caller without it
        start = generation_pb2.GenerateStreamsRequest(
            id=1, start=generation_pb2.GenerateStreamRequest(input=generation_pb2.GenerationInput(text="x"))
        )
        with pytest.raises(grpc.RpcError) as info:
            list(generation_pb2_grpc.GenerationStub(ch).GenerateStreams(iter([start]), timeout=30))
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_openai_batch_files_through_run(stack: Stack, model_id: str, tmp_path: Path) -> None:
    """`moe-lightning run` on an OpenAI Batch file: one result per line, in order, each answered as
    the gateway answers the same body; a bad line is that line's error, and the others still run."""
    chat = {"model": model_id, "messages": CHAT, "max_tokens": 6, "temperature": 0}
    completion = {
        "model": model_id,
        "prompt": "Once upon a time",
        "max_tokens": 5,
        "n": 2,
        "seed": 3,
        "temperature": 0.7,
    }
    scoring = {"model": model_id, "prompt": "Once upon a time", "max_tokens": 0, "logprobs": 1, "echo": True}
    controls = {
        **chat,
        "logit_bias": {"5": 4.0},
        "repetition_penalty": 1.4,
        "frequency_penalty": 0.5,
        "min_tokens": 3,
        "stop_token_ids": [7],
    }
    lines = [
        {"custom_id": "chat-1", "method": "POST", "url": "/v1/chat/completions", "body": chat},
        {"custom_id": "cmpl-1", "method": "POST", "url": "/v1/completions", "body": completion},
        {
            "custom_id": "bad-temp",
            "method": "POST",
            "url": "/v1/completions",
            "body": {**completion, "temperature": -1},
        },
        {"custom_id": "bad-url", "method": "POST", "url": "/v1/embeddings", "body": {"model": model_id, "input": "x"}},
        {
            "custom_id": "too-long",
            "method": "POST",
            "url": "/v1/completions",
            "body": {**completion, "max_tokens": 10**6},
        },
        # the new fields read as the gateway reads them: echo + logprobs (scoring), and the controls
        {"custom_id": "echo", "method": "POST", "url": "/v1/completions", "body": scoring},
        {"custom_id": "controls", "method": "POST", "url": "/v1/chat/completions", "body": controls},
    ]
    src, out = tmp_path / "batch.jsonl", tmp_path / "results.jsonl"
    src.write_text("".join(json.dumps(line) + "\n" for line in lines))
    r = cli(
        "run",
        "--addr",
        stack.api_address,
        "--input",
        str(src),
        "--output",
        str(out),
        "--no-progress",
        "--chunk-size",
        "8",
    )
    assert r.returncode == 0, r.stderr
    results = [json.loads(line) for line in out.read_text().splitlines()]
    assert [x["custom_id"] for x in results] == [line["custom_id"] for line in lines]
    assert [x["response"]["status_code"] for x in results] == [200, 200, 400, 400, 400, 200, 200]
    http = client(stack)
    want_chat = http.chat.completions.create(**chat).choices[0].message.content  # type: ignore[call-overload]
    assert results[0]["response"]["body"]["choices"][0]["message"]["content"] == want_chat
    want = [c.text for c in http.completions.create(**completion).choices]  # type: ignore[call-overload]
    assert [c["text"] for c in results[1]["response"]["body"]["choices"]] == want
    assert results[2]["response"]["body"]["error"]["param"] == "temperature"
    assert "url must be one of" in results[3]["response"]["body"]["error"]["message"]
    assert "context" in results[4]["response"]["body"]["error"]["message"]
    direct = [  # the same bodies straight to the gateway
        httpx.post(f"{stack.http_address}{path}", json=body, timeout=60).json()["choices"]
        for path, body in (("/v1/completions", scoring), ("/v1/chat/completions", controls))
    ]
    assert results[5]["response"]["body"]["choices"] == direct[0]
    assert results[6]["response"]["body"]["choices"] == direct[1]
