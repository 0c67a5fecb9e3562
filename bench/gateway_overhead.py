"""What the OpenAI-compatible gateway costs: 64 concurrent streaming clients through HTTP against 64
through the gRPC API, same prompts, same stack, alternated in rounds (docs/openai.md, "Overhead").

Prints, per round and as medians:
- tokens/s both ways and their ratio (target: HTTP within 5 % of gRPC at batch 64);
- the gateway's process CPU per request, not streamed (its fixed cost per request: parse, check,
  one gRPC call, one JSON answer; target under 2 ms) and streamed, and from the two its CPU per
  streamed event (what `--stream-interval` divides);
- the CPU of the clients and of the stack's own services in each kind of round, so that a tokens/s
  ratio on a few shared cores can be read: every CPU second the gateway or a client takes is one the
  stack does not get.

    python bench/gateway_overhead.py [--preset bench|tiny | --model DIR] [--clients 64] [--tokens 32]
                                     [--rounds 3] [--stream-interval 1] [--json OUT]

--preset bench (the default) is the demo model benchmarks use on a CPU box, a step at batch 64 of
about a second here; --preset tiny makes a step ~35 ms on two cores, the gateway's worst case, where its
per-token CPU is as large as the stack's. The HTTP clients are aiohttp's (a C parser, as vLLM's
serving benchmark uses); the gRPC clients are grpc.aio's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import grpc
import httpx

from moe_lightning.api.generation.v1 import generation_pb2, generation_pb2_grpc
from moe_lightning.config.stack import StackConfig
from moe_lightning.launcher import Stack


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
    connector = aiohttp.TCPConnector(limit=len(prompts))
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(base, connector=connector, timeout=timeout) as session:

        async def one(p: str) -> tuple[int, int]:
            body = {"model": model, "prompt": p, "max_tokens": tokens, "stream": stream, "ignore_eos": True}
            if not stream:
                async with session.post("/v1/completions", json=body) as r:
                    return (await r.json())["usage"]["completion_tokens"], 1
            body["stream_options"] = {"include_usage": True}
            n = events = 0
            async with session.post("/v1/completions", json=body) as r:
                r.raise_for_status()
                async for line in r.content:
                    if line.startswith(b"data: "):
                        events += 1
                        if line.startswith(b"data: {") and b'"usage"' in line:
                            n = json.loads(line[6:])["usage"]["completion_tokens"]
            return n, events

        t0 = time.perf_counter()
        counts = await asyncio.gather(*(one(p) for p in prompts))
        return sum(c[0] for c in counts), time.perf_counter() - t0, sum(c[1] for c in counts)


def process_cpu(pids: list[int]) -> float:
    """User + system CPU seconds of these processes so far (Linux /proc)."""
    total = 0
    for pid in pids:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
        total += int(fields[11]) + int(fields[12])
    return total / os.sysconf("SC_CLK_TCK")


class Meter:
    """CPU seconds of the gateway, of this process (the clients) and of the stack's services."""

    def __init__(self, stack: Stack) -> None:
        self.stack = stack
        self.gateway = [stack.procs["gateway"].pid]
        self.services = [p.pid for name, p in stack.procs.items() if name != "gateway"]

    def read(self) -> tuple[float, float, float]:
        return process_cpu(self.gateway), time.process_time(), process_cpu(self.services)


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
    ap.add_argument("--preset", choices=["bench", "tiny"], default="bench", help="demo model built here")
    ap.add_argument("--model", type=Path, default=None, help="a checkpoint instead of --preset")
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

        model = write_demo_model(work / args.preset, args.preset, seed=0, progress=True)
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
    n = len(prompts)
    rows = []
    with Stack(config) as stack:
        base, name, meter = stack.http_address, model.name, Meter(stack)
        asyncio.run(http_round(base, name, prompts[:4], 4))  # warm both paths
        asyncio.run(grpc_round(stack.api_address, prompts[:4], 4))
        for r in range(args.rounds):
            m0 = meter.read()
            g_tokens, g_s, g_msgs = asyncio.run(grpc_round(stack.api_address, prompts, args.tokens))
            m1, o1 = meter.read(), overhead(base)
            m2 = meter.read()
            h_tokens, h_s, h_events = asyncio.run(http_round(base, name, prompts, args.tokens))
            m3, o2 = meter.read(), overhead(base)
            row = {
                "round": r,
                "grpc_tok_s": g_tokens / g_s,
                "http_tok_s": h_tokens / h_s,
                "http_over_grpc": (h_tokens / h_s) / (g_tokens / g_s),
                "gateway_cpu_ms_per_request": 1e3 * (m3[0] - m2[0]) / n,
                "gateway_ms_per_request": 1e3 * (o2[0] - o1[0]) / max(1.0, o2[1] - o1[1]),
                "cpu_s": {
                    "grpc_round": {"clients": m1[1] - m0[1], "stack": m1[2] - m0[2]},
                    "http_round": {"clients": m3[1] - m2[1], "gateway": m3[0] - m2[0], "stack": m3[2] - m2[2]},
                },
                "tokens": [g_tokens, h_tokens],
                "grpc_messages_per_stream": g_msgs / n,
                "http_events_per_stream": h_events / n,
            }
            rows.append(row)
            c = row["cpu_s"]
            print(
                f"round {r}: gRPC {row['grpc_tok_s']:8.1f} tok/s, HTTP {row['http_tok_s']:8.1f} tok/s "
                f"({row['http_over_grpc']:.3f}); gateway CPU {row['gateway_cpu_ms_per_request']:.2f} ms/request, "
                f"{g_msgs / n:.1f} gRPC messages / {h_events / n:.1f} SSE events per stream; CPU s: gRPC round "
                f"clients {c['grpc_round']['clients']:.2f} stack {c['grpc_round']['stack']:.2f}, HTTP round clients "
                f"{c['http_round']['clients']:.2f} gateway {c['http_round']['gateway']:.2f} "
                f"stack {c['http_round']['stack']:.2f}",
                file=sys.stderr,
            )
        m0 = meter.read()
        plain_tokens, _, _ = asyncio.run(http_round(base, name, prompts, args.tokens, stream=False))
        plain_cpu = 1e3 * (meter.read()[0] - m0[0]) / n
    ratio = statistics.median(r["http_over_grpc"] for r in rows)
    ms = statistics.median(r["gateway_ms_per_request"] for r in rows)
    cpu = statistics.median(r["gateway_cpu_ms_per_request"] for r in rows)
    events = statistics.median(r["http_events_per_stream"] for r in rows)
    per_event = (cpu - plain_cpu) / events
    complete = all(r["tokens"] == [n * args.tokens] * 2 for r in rows) and plain_tokens == n * args.tokens
    print(
        f"{n} streaming clients x {args.tokens} tokens, --stream-interval {args.stream_interval}, "
        f"{args.model or args.preset} model, median of {args.rounds} rounds:"
    )
    print(f"  HTTP / gRPC tokens/s                    {ratio:7.3f}   target >= 0.95")
    print(f"  gateway CPU per request, not streamed   {plain_cpu:7.3f} ms   target < 2 (its fixed cost per request)")
    print(f"  gateway CPU per request, streamed       {cpu:7.3f} ms   ({events:.1f} events)")
    print(f"  gateway CPU per streamed event          {1e3 * per_event:7.1f} us   (what --stream-interval divides)")
    print(f"  gateway time per request, not on gRPC   {ms:7.3f} ms   (wall time, on shared cores)")
    print(f"  every stream complete                   {complete}")
    if args.json is not None:
        summary = {
            "model": str(args.model or args.preset),
            "clients": n,
            "tokens": args.tokens,
            "stream_interval": args.stream_interval,
            "http_over_grpc": ratio,
            "gateway_cpu_ms_per_request": cpu,
            "gateway_cpu_ms_per_plain_request": plain_cpu,
            "gateway_cpu_us_per_event": 1e3 * per_event,
            "gateway_ms_per_request": ms,
            "complete": complete,
        }
        args.json.write_text(json.dumps({"summary": summary, "rounds": rows}, indent=2))
    return 0 if complete else 1


if __name__ == "__main__":
    raise SystemExit(main())
