"""Batch jobs that fill the batch the server plans: the client's batch helper, `run`'s automatic
in-flight count and the orchestrator's queue bound, against one real stack whose planned batch
(600) is well above what the old fixed in-flight count (4 calls x 64 = 256 prompts) reached."""

from __future__ import annotations

import random
import re
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import grpc
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from moe_lightning.api.generation.v1 import generation_pb2
from moe_lightning.client import BatchError, GenerationClient, Prompt, plan_in_flight
from moe_lightning.launcher import Stack

BATCH = 600
NEW_TOKENS = 12  # long enough that the first chunks still decode when the last ones arrive


@pytest.fixture(scope="module")
def stack(tiny_model: Path, make_module_stack: Callable[..., Stack]) -> Stack:
    # one micro-batch per step: many micro-batches per step deadlock the hand-off channels for now
    return make_module_stack(model=tiny_model, max_batch_size=BATCH, micro_batch_size=0)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(1, 512) for _ in range(rng.randint(2, 8))] for _ in range(800)]


@pytest.fixture(scope="module")
def expected(tiny_model: Path, prompts: list[list[int]]) -> list[list[int]]:
    """Greedy tokens of the in-process engine, all prompts in one batch."""
    import torch

    from moe_lightning.checkpoint import load_model_weights
    from moe_lightning.engine import InProcessEngine
    from moe_lightning.request import GenerationRequest
    from moe_lightning.spec import ModelSpec

    spec = ModelSpec.from_pretrained(tiny_model)
    weights = load_model_weights(tiny_model, spec, torch.float32, "cpu", progress=False)
    requests = [GenerationRequest(p, NEW_TOKENS, ignore_eos=True) for p in prompts]
    results, _ = InProcessEngine(spec, weights).generate(requests)
    return [r.token_ids for r in results]


def _decode_batches(stack: Stack) -> tuple[float, float]:
    """(decode steps so far, of them with more than 256 sequences) from the orchestrator's histogram."""
    with urllib.request.urlopen(stack.endpoints()["orchestrator"]["metrics"], timeout=10) as r:
        text = r.read().decode()
    count = re.search(r"^moe_lightning_decode_batch_size_count (\S+)$", text, re.M)
    upto = re.search(r'^moe_lightning_decode_batch_size_bucket\{le="256\.0"\} (\S+)$', text, re.M)
    assert count and upto, "the orchestrator exports moe_lightning_decode_batch_size"
    return float(count[1]), float(count[1]) - float(upto[1])


def test_in_flight_plan() -> None:
    """Enough calls for the planned batch plus one, within the queue; an explicit count wins."""

    def meta(batch: int, queue: int = 0, mu: int = 0) -> generation_pb2.GetServerMetadataResponse:
        return generation_pb2.GetServerMetadataResponse(
            max_batch_size=batch, max_queue_size=queue, max_batch_prompts=1024, micro_batch_size=mu
        )

    p = plan_in_flight(meta(600, 6144), 64)
    assert (p.chunks, p.prompts, p.bound) == (11, 704, "planned batch")
    assert "planned batch 600" in p.describe() and "704 prompts" in p.describe()
    p = plan_in_flight(meta(4160, 6144, 320), 64)
    assert p.chunks == 66 and "13 micro-batches x 320" in p.describe()
    assert plan_in_flight(meta(4096, 1024), 64).chunks == 16  # what the queue admits
    assert plan_in_flight(meta(4096, 1024), 64).bound == "queue"
    assert plan_in_flight(meta(4096, 6144), 64, in_flight=4).prompts == 256
    assert plan_in_flight(meta(8, 2), 64).chunk_size == 2  # a chunk the queue can take at once
    assert plan_in_flight(meta(9000, 20000), 5000).chunk_size == 1024
    # the orchestrator's default queue holds what the helper keeps in flight, for any chunk size
    from orchestrator.server import default_max_queue

    for batch, chunk in [(4096, 1000), (4096, 1024), (4096, 1), (9000, 1000), (600, 64)]:
        queue = default_max_queue(batch if batch > 4096 else None)
        assert plan_in_flight(meta(batch, queue), chunk).bound == "planned batch"


def test_run_keeps_the_planned_batch_running(
    stack: Stack, prompts: list[list[int]], expected: list[list[int]], tmp_path: Path
) -> None:
    """`run` with the default --in-flight decodes more than 256 sequences at once, and every row is
    the engine's greedy output. Chunks of 16 need 39 calls in flight: more than a 16-thread server
    serves at once."""
    src, out = tmp_path / "in.parquet", tmp_path / "out.parquet"
    pq.write_table(pa.table({"prompt_ids": prompts, "id": list(range(len(prompts)))}), src)
    steps0, big0 = _decode_batches(stack)
    args = ["--input", str(src), "--output", str(out), "--max-new-tokens", str(NEW_TOKENS), "--ignore-eos"]
    r = subprocess.run(
        [sys.executable, "-m", "moe_lightning.cli", "run", "--addr", stack.api_address, *args, "--chunk-size", "16"],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert r.returncode == 0, r.stderr
    assert "keeping up to 624 prompts in flight (39 BatchGenerate calls of 16)" in r.stderr
    assert "planned batch 600" in r.stderr
    steps, big = _decode_batches(stack)
    assert big - big0 >= 1, (steps - steps0, big - big0)  # decode steps with more than 256 sequences
    rows = pq.read_table(out).to_pylist()
    assert [row["id"] for row in rows] == list(range(len(prompts)))
    assert [row["token_ids"] for row in rows] == expected


def test_a_burst_over_1024_requests_is_queued(stack: Stack) -> None:
    """Three BatchGenerate calls of 1,000 at once: 3,000 requests, most of them waiting behind the
    batch of 600, all admitted by the default --max-queue."""
    with GenerationClient(stack.api_address, timeout=120) as c:
        meta = c.server_metadata()
        assert meta.max_queue_size == 4096 + 2 * 1024 and meta.max_batch_size == BATCH
        assert meta.micro_batch_size == 0 and meta.max_batch_prompts == 1024
        calls = [
            c.stub.BatchGenerate.future(
                generation_pb2.BatchGenerateRequest(
                    inputs=[Prompt(token_ids=[1 + (i + k) % 500, 7], max_new_tokens=2).to_pb() for i in range(1000)]
                ),
                timeout=120,
            )
            for k in range(3)
        ]
        outputs = [o for call in calls for o in call.result().outputs]
    assert len(outputs) == 3000 and all(len(o.token_ids) >= 1 for o in outputs)


def test_batch_helper_order_callbacks_and_a_bad_row(
    stack: Stack, prompts: list[list[int]], expected: list[list[int]]
) -> None:
    seen: list[int] = []
    plans: list[str] = []
    with GenerationClient(stack.api_address, timeout=120) as c:
        some = [Prompt(token_ids=p, max_new_tokens=NEW_TOKENS, ignore_eos=True) for p in prompts[:150]]
        done = c.batch_generate_all(
            some, chunk_size=16, on_result=lambda i, _c: seen.append(i), on_plan=lambda p: plans.append(p.describe())
        )
        assert [d.token_ids for d in done] == expected[:150]  # input order
        assert sorted(seen) == list(range(150))  # one call per row
        assert plans and "planned batch 600" in plans[0]

        bad = list(some)
        bad[37] = Prompt(token_ids=[3, 10**6], max_new_tokens=NEW_TOKENS)
        t0 = time.monotonic()
        with pytest.raises(BatchError) as info:
            c.batch_generate_all(bad, chunk_size=16)
        assert time.monotonic() - t0 < 60  # the other calls were cancelled, not waited for forever
        assert info.value.row == 37 and info.value.rows == list(range(32, 48))
        assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert "row 37" in str(info.value) and "outside the vocabulary" in str(info.value)
        # the server serves on after the cancelled calls
        assert c.generate(some[0]).token_ids == expected[0]
