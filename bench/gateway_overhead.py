"""What the OpenAI-compatible gateway costs: 64 concurrent streaming clients through HTTP against 64
through the gRPC API, same prompts, same stack, alternated in rounds (docs/openai.md, "Overhead").
Prints tokens/s both ways and their ratio, and the gateway's own time per request (its metric
`moe_lightning_gateway_overhead_seconds`: the request's time less its waits on the gRPC API).
Targets: under 2 ms per request, under 5 % of tokens/s.

    python bench/gateway_overhead.py [--model DIR] [--clients 64] [--tokens 32] [--rounds 3]
                                     [--stream-interval 1] [--json OUT]

--stream-interval N starts the stack with `up --stream-interval N`: both APIs' streams send a message
per N tokens, so per-message costs (gRPC reads, SSE events, socket writes) are paid N times less.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

import grpc
import httpx

from moe_lightning.api.generation.v1 import generation_pb2, generation_pb2_grpc
from moe_lightning.launcher import Stack, StackConfig


async def grpc_round(address: str, prompts: list[str], tokens: int) -> tuple[int, float, int]:
    """(tokens, seconds, messages): a message may carry several tokens when its reader fell behind."""
    async with grpc.aio.insecure_channel(address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)

        async def one(p: str) -> tuple[int, int]:
            m = generation_pb2.GenerationInput(text=p, max_new_tokens=tokens, ignore_eos=True)
            n = messages = 0
            async for msg in stub.GenerateStream(generation_pb2.GenerateStreamRequest(input=m)):
                n += len(msg.token_ids)
                messages += 1
            return n, messages

        t0 = time.perf_counter()
        counts = await asyncio.gather(*(one(p) for p in prompts))
        return sum(c[0] for c in counts), time.perf_counter() - t0, sum(c[1] for c in counts)


async def http_round(
    base: str, model: str, prompts: list[str], tokens: int, stream: bool = True
) -> tuple[int, float, int]:
    """(tokens, seconds, events)."""
    limits = httpx.Limits(max_connections=len(prompts))
    async with httpx.AsyncClient(base_url=base, timeout=600, limits=limits) as client:

        async def one(p: str) -> tuple[int, int]:
            body = {"model": model, "prompt": p, "max_tokens": tokens, "stream": stream, "ignore_eos": True}
            if not stream:
                r = await client.post("/v1/completions", json=body)
                return r.json()["usage"]["completion_tokens"], 1
            body["stream_options"] = {"include_usage": True}
            n = events = 0
            async with client.stream("POST", "/v1/completions", json=body) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: "):
                        events += 1
                    if line.startswith("data: {") and '"usage"' in line:
                        n = json.loads(line[6:])["usage"]["completion_tokens"]
            return n, events

        t0 = time.perf_counter()
        counts = await asyncio.gather(*(one(p) for p in prompts))
        return sum(c[0] for c in counts), time.perf_counter() - t0, sum(c[1] for c in counts)


def overhead(base: str) -> tuple[float, float, float]:
    """(the gateway's own seconds, requests, its process's CPU seconds) so far, from its /metrics."""
    text = httpx.get(f"{base}/metrics").text

    def value(name: str) -> float:
        return float(re.search(rf"^{name} (\S+)", text, re.M)[1])  # type: ignore[index]

    return (
        value("moe_lightning_gateway_overhead_seconds_sum"),
        value("moe_lightning_gateway_overhead_seconds_count"),
        value("process_cpu_seconds_total"),
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=None, help="checkpoint (default: a tiny demo model, built here)")
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=32, help="generated per request")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--stream-interval", type=int, default=1, help="tokens per streamed message (the server's)")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="moe-lightning-gateway-bench-"))
    model = args.model
    if model is None:
        from moe_lightning.demo_model import write_demo_model

        model = write_demo_model(work / "tiny", "tiny", seed=0, progress=False)
    config = StackConfig(
        model=model,
        run_id=f"gwbench{int(time.time())}",
        port=0,
        http_port=0,
        max_batch_size=args.clients,
        stream_interval=args.stream_interval,
        kv_cache_memory="1GiB",
        log_dir=work / "logs",
        cache_dir=work / "arena-cache",
    )
    prompts = [f"request {i}: once upon a time" for i in range(args.clients)]
    rows = []
    with Stack(config) as stack:
        base, name = stack.http_address, model.name
        asyncio.run(http_round(base, name, prompts[:4], 4))  # warm both paths
        asyncio.run(grpc_round(stack.api_address, prompts[:4], 4))
        for r in range(args.rounds):
            g_tokens, g_s, g_msgs = asyncio.run(grpc_round(stack.api_address, prompts, args.tokens))
            before = overhead(base)
            h_tokens, h_s, h_events = asyncio.run(http_round(base, name, prompts, args.tokens))
            after = overhead(base)
            requests = max(1.0, after[1] - before[1])
            per_request_ms = 1e3 * (after[0] - before[0]) / requests
            cpu_ms = 1e3 * (after[2] - before[2]) / requests
            rows.append(
                {
                    "round": r,
                    "grpc_tok_s": g_tokens / g_s,
                    "http_tok_s": h_tokens / h_s,
                    "http_over_grpc": (h_tokens / h_s) / (g_tokens / g_s),
                    "gateway_ms_per_request": per_request_ms,
                    "gateway_cpu_ms_per_request": cpu_ms,
                    "tokens": [g_tokens, h_tokens],
                    "grpc_messages_per_stream": g_msgs / len(prompts),
                    "http_events_per_stream": h_events / len(prompts),
                }
            )
            print(
                f"round {r}: gRPC {g_tokens / g_s:8.1f} tok/s, HTTP {h_tokens / h_s:8.1f} tok/s "
                f"({rows[-1]['http_over_grpc']:.3f}), gateway {per_request_ms:.3f} ms/request, "
                f"{g_msgs / len(prompts):.1f} gRPC messages / {h_events / len(prompts):.1f} SSE events per stream",
                file=sys.stderr,
            )
        before = overhead(base)
        plain_tokens, _, _ = asyncio.run(http_round(base, name, prompts, args.tokens, stream=False))
        after = overhead(base)
        plain_cpu_ms = 1e3 * (after[2] - before[2]) / max(1.0, after[1] - before[1])
    ratio = statistics.median(r["http_over_grpc"] for r in rows)
    ms = statistics.median(r["gateway_ms_per_request"] for r in rows)
    cpu = statistics.median(r["gateway_cpu_ms_per_request"] for r in rows)
    complete = all(r["tokens"] == [args.clients * args.tokens] * 2 for r in rows)
    print(
        f"{args.clients} streaming clients x {args.tokens} tokens, --stream-interval {args.stream_interval}, "
        f"median of {args.rounds} rounds:"
    )
    print(f"  HTTP / gRPC tokens/s   {ratio:6.3f}   target >= 0.95")
    print(f"  gateway CPU ms/request {cpu:6.3f}   target < 2 (its process's CPU time per request)")
    print(f"  gateway wall ms/request {ms:6.3f}  (time in the gateway, not waiting on gRPC; on shared cores)")
    print(f"  every stream complete  {complete}")
    print(f"  not streamed: gateway CPU ms/request {plain_cpu_ms:.3f} ({plain_tokens} tokens)")
    if args.json is not None:
        args.json.write_text(
            json.dumps(
                {
                    "rounds": rows,
                    "stream_interval": args.stream_interval,
                    "http_over_grpc": ratio,
                    "gateway_ms_per_request": ms,
                    "gateway_cpu_ms_per_request": cpu,
                    "complete": complete,
                },
                indent=2,
            )
        )
    return 0 if complete else 1


if __name__ == "__main__":
    raise SystemExit(main())
