"""The dashboard picture in docs/operations.md, from a real run: a stack (the tiny demo model unless
--model, experts streamed within a small device budget), a Prometheus scraping it with deploy/'s config
and alerts, waves of requests through both APIs for --seconds, then every panel of the Grafana
dashboard drawn from that Prometheus with matplotlib (bench/monitoring/dashboard.py: Grafana is not a
Debian package, so no headless browser can shoot the real one here). The orchestrator's live
/debug/timeline.png is saved beside it.

    python bench/dashboard_snapshot.py [--seconds 100] [--out docs/dashboard.png]
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import httpx

from bench.monitoring import dashboard, prometheus
from moe_lightning.client import GenerationClient, Prompt
from moe_lightning.config.stack import StackConfig
from moe_lightning.demo_model import write_demo_model
from moe_lightning.launcher import Stack
from moe_lightning.spec import ModelSpec

from reference import device_budget

ROOT = Path(__file__).resolve().parents[1]


def load(stack: Stack, seconds: float, stop: threading.Event) -> None:
    """Waves of batches bigger than the running batch (so requests queue), streams, gateway requests
    and now and then a client's mistake, until `seconds` have passed."""
    rng = random.Random(0)
    model = httpx.get(f"{stack.http_address}/v1/models").json()["data"][0]["id"]

    def batch(n: int, tokens: int) -> None:
        with GenerationClient(stack.api_address, timeout=300) as c:
            prompts = [
                Prompt(token_ids=[1, *rng.sample(range(3, 500), rng.randint(4, 60))], max_new_tokens=tokens)
                for _ in range(n)
            ]
            c.batch_generate([Prompt(token_ids=p.token_ids, max_new_tokens=tokens, ignore_eos=True) for p in prompts])

    end = time.monotonic() + seconds
    wave = 0
    while time.monotonic() < end and not stop.is_set():
        wave += 1
        n = (8, 24, 48, 16)[wave % 4]
        workers = [threading.Thread(target=batch, args=(n // 2, rng.choice((32, 64, 96)))) for _ in range(2)]
        for w in workers:
            w.start()
        with GenerationClient(stack.api_address, timeout=300) as c:
            list(c.stream(Prompt(text="Once upon a time", max_new_tokens=48)))
            if wave % 3 == 0:
                try:
                    c.generate(Prompt(token_ids=[1, 10**6], max_new_tokens=4))  # INVALID_ARGUMENT
                except Exception:
                    pass
        httpx.post(
            f"{stack.http_address}/v1/completions",
            json={"model": model, "prompt": "Hello", "max_tokens": 24},
            timeout=300,
        )
        if wave % 4 == 0:
            httpx.post(f"{stack.http_address}/v1/completions", json={"model": "nope", "prompt": "Hi"}, timeout=30)
        for w in workers:
            w.join()
        time.sleep(rng.uniform(0.5, 3.0))  # idle gaps: the rates fall and rise as on a real server


def full_batch(stack: Stack) -> None:
    with GenerationClient(stack.api_address, timeout=300) as c:
        c.batch_generate([Prompt(token_ids=[1, 5 + i, 9], max_new_tokens=64, ignore_eos=True) for i in range(16)])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=None, help="a checkpoint directory (default: the tiny demo model)")
    p.add_argument("--seconds", type=float, default=100.0, help="how long the load runs")
    p.add_argument("--out", type=Path, default=ROOT / "docs" / "dashboard.png")
    p.add_argument("--timeline-out", type=Path, default=ROOT / "docs" / "timeline-live.png")
    args = p.parse_args()
    found = prometheus.binaries()
    if isinstance(found, str):
        sys.exit(found)
    with tempfile.TemporaryDirectory(prefix="dashboard-snapshot-") as tmp:
        work = Path(tmp)
        model = args.model or write_demo_model(work / "tiny", "tiny", seed=0, progress=False)
        spec = ModelSpec.from_pretrained(model)
        config = StackConfig(
            model=model,
            run_id=f"snapshot{int(time.time())}",
            port=0,
            http_port=0,
            kv_cache_memory="1MiB",  # ~2,000 tokens of the tiny model: the KV cache limits admission
            max_batch_size=16,
            micro_batch_size=8,
            experts_placement="gpu",
            device_memory=str(device_budget(model, ring=spec.num_experts + 1)),
            log_dir=work / "logs",
            extra={"orchestrator": ["--max-queue", "64"]},  # the waves fill it up to ~3/4
        )
        with Stack(config) as stack:
            prom = prometheus.Prometheus(found[0], work, prometheus.config_for(prometheus.targets_of(stack)))
            prom.start()
            try:
                prom.wait_scraped(set(prometheus.targets_of(stack)))
                start = time.time()
                load(stack, args.seconds, threading.Event())
                end = time.time() + 3  # the job's last scrapes
                full = threading.Thread(target=full_batch, args=(stack,))  # the picture of a full batch's steps
                full.start()
                time.sleep(1.5)
                url = f"http://127.0.0.1:{stack.metrics_ports['orchestrator']}/debug/timeline.png"
                with urllib.request.urlopen(url, timeout=60) as r:
                    args.timeline_out.write_bytes(r.read())
                full.join()
                time.sleep(max(0.0, end - time.time()))
                dashboard.render(prom, dashboard.load(), start, end, args.out, step=2.0)
            finally:
                prom.stop()
    print(f"wrote {args.out} and {args.timeline_out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
