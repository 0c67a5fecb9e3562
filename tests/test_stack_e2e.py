"""End to end through real processes: the four services, shared memory, gRPC, against transformers."""

from __future__ import annotations

import re
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest

from moe_lightning.client import Completion, GenerationClient, Prompt, StreamChunk
from moe_lightning.launcher import SERVICES, Stack
from moe_lightning.service.upstream import health_status, open_channel

from reference import E2E_PROMPTS as PROMPTS


def watch_health(address: str, until: int, timeout: float = 120.0) -> int | None:
    channel = open_channel(address)
    deadline = time.monotonic() + timeout
    status = None
    while time.monotonic() < deadline and status != until:
        status = health_status(channel, SERVICES["orchestrator"].health, timeout=0.5)
        time.sleep(0.05)
    channel.close()
    return status


@pytest.fixture(scope="module")
def stack(make_module_stack: Callable[..., Stack], tmp_path_factory: pytest.TempPathFactory) -> Stack:
    s = make_module_stack(
        max_batch_size=6,
        micro_batch_size=4,
        cache_dir=tmp_path_factory.mktemp("arena"),
        extra={"orchestrator": ["--max-prefill-tokens", "40"]},  # several prefill micro-batches
        start=False,  # started here in two stages
    )
    s.prepare()
    # The orchestrator first: it must say NOT_SERVING until everything behind it is up.
    s.spawn(["orchestrator"])
    s.health_seen = [watch_health(s.api_address, until=2)]  # type: ignore[attr-defined]
    s.spawn(["weight_store", "cpu_attention", "gpu_expert"])
    s.health_seen.append(watch_health(s.api_address, until=1))  # type: ignore[attr-defined]
    s.wait_ready(60)
    return s


@pytest.fixture(scope="module")
def client(stack: Stack) -> Iterator[GenerationClient]:
    with GenerationClient(stack.api_address, timeout=120) as c:
        yield c


def test_health_went_not_serving_then_serving(stack: Stack) -> None:
    assert stack.health_seen == [2, 1]  # type: ignore[attr-defined]  # NOT_SERVING, then SERVING


def test_batch_generate_equals_transformers_generate(client: GenerationClient, reference: dict) -> None:
    done = client.batch_generate([Prompt(token_ids=p, max_new_tokens=14) for p in PROMPTS])
    assert len(done) == len(PROMPTS) >= 8
    for i, c in enumerate(done):
        assert c.token_ids == reference[i], f"prompt {i}"
        assert c.prompt_tokens == len(PROMPTS[i])
        assert c.finish_reason == ("eos" if c.token_ids[-1] == 2 else "length")


def test_stream_yields_the_same_tokens_incrementally(client: GenerationClient, reference: dict) -> None:
    for i in (0, 3, 8):
        parts = list(client.stream(Prompt(token_ids=PROMPTS[i], max_new_tokens=14)))
        final = parts[-1]
        assert isinstance(final, Completion)
        pieces = [p for p in parts if isinstance(p, StreamChunk)]
        # a message per step (several steps' tokens in one only when the reader falls behind)
        assert 1 < len(pieces) <= len(final.token_ids)
        assert [t for p in pieces for t in p.token_ids] == final.token_ids == reference[i]
        assert all(p.text == "" for p in pieces)  # this model has no tokenizer


def test_stream_interval_sends_fewer_larger_messages(client: GenerationClient, reference: dict) -> None:
    """A request's stream_interval: every message but the last carries at least that many tokens."""
    parts = list(client.stream(Prompt(token_ids=PROMPTS[3], max_new_tokens=14), stream_interval=5))
    *pieces, final = parts
    assert isinstance(final, Completion) and final.token_ids == reference[3]
    assert [t for p in pieces for t in p.token_ids] == reference[3]
    assert all(len(p.token_ids) >= 5 for p in pieces[:-1]) and 2 <= len(pieces) <= 3


def test_seeded_sampling_is_reproducible(client: GenerationClient) -> None:
    def draw(seed: int) -> list[int]:
        p = Prompt(token_ids=PROMPTS[2], max_new_tokens=12, temperature=1.3, top_p=0.95, seed=seed, ignore_eos=True)
        return client.generate(p).token_ids

    a, b, c = draw(11), draw(11), draw(12)
    assert a == b and a != c


def test_concurrent_unary_requests_are_batched_and_exact(client: GenerationClient, reference: dict) -> None:
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(8) as pool:
        done = list(pool.map(lambda p: client.generate(Prompt(token_ids=p, max_new_tokens=14)), PROMPTS))
    assert [c.token_ids for c in done] == [reference[i] for i in range(len(PROMPTS))]


def test_model_info_and_metadata(client: GenerationClient, hf_dir: Path) -> None:
    info = client.model_info().model
    assert info.architecture == "MixtralForCausalLM" and info.num_layers == 3 and info.num_experts == 6
    meta = client.server_metadata()
    assert meta.max_batch_size == 6 and meta.kv_cache_tokens > 0 and meta.device == "cpu"


@pytest.mark.parametrize(
    ("prompt", "code", "message"),
    [
        (Prompt(token_ids=[]), grpc.StatusCode.INVALID_ARGUMENT, "prompt is empty"),
        (Prompt(token_ids=[1, 320]), grpc.StatusCode.INVALID_ARGUMENT, "allowed: 0..319"),
        (Prompt(token_ids=[1], max_new_tokens=0), grpc.StatusCode.INVALID_ARGUMENT, "max_new_tokens must be >= 1"),
        (Prompt(token_ids=[1], top_p=0.0), grpc.StatusCode.INVALID_ARGUMENT, "top_p must be in (0, 1]"),
        (Prompt(token_ids=[1], temperature=-1.0), grpc.StatusCode.INVALID_ARGUMENT, "temperature must be"),
        (Prompt(text="hello"), grpc.StatusCode.INVALID_ARGUMENT, "no tokenizer"),
        (Prompt(token_ids=[1], stop=["0"]), grpc.StatusCode.INVALID_ARGUMENT, "stop strings need"),  # hypothesis
        (Prompt(token_ids=list(range(1, 60))), grpc.StatusCode.INVALID_ARGUMENT, "at most 40"),
    ],
)
def test_bad_input_gets_invalid_argument(
    client: GenerationClient, prompt: Prompt, code: grpc.StatusCode, message: str
) -> None:
    with pytest.raises(grpc.RpcError) as info:
        client.generate(prompt)
    assert info.value.code() == code
    assert message in info.value.details()


def test_metrics_endpoints_have_the_series(stack: Stack, client: GenerationClient) -> None:
    client.generate(Prompt(token_ids=[1, 2, 3], max_new_tokens=3))

    def scrape(name: str) -> str:
        with urllib.request.urlopen(stack.endpoints()[name]["metrics"], timeout=10) as r:
            return r.read().decode()

    orch = scrape("orchestrator")
    for series in (
        "moe_lightning_requests_total",
        "moe_lightning_generation_tokens_total",
        "moe_lightning_prompt_tokens_total",
        "moe_lightning_time_to_first_token_seconds_bucket",
        "moe_lightning_e2e_request_latency_seconds_bucket",
        "moe_lightning_kv_cache_usage_ratio",
        "moe_lightning_requests_running",
        "moe_lightning_requests_waiting",
        'moe_lightning_stage_seconds_total{kind="decode",stage="post_attention"}',
        "moe_lightning_policy_info{",
        'moe_lightning_stage_predicted_seconds{stage="device"}',
        'moe_lightning_stage_measured_seconds{stage="attention"}',
        "moe_lightning_predicted_decode_tokens_per_second",
    ):
        assert series in orch, series
    assert float(re.search(r'moe_lightning_requests_total\{outcome="length"\} (\S+)', orch)[1]) >= 1
    attn = scrape("cpu_attention")
    for series in (
        "moe_lightning_kv_cache_usage_ratio",
        'moe_lightning_stage_busy_seconds_total{stage="decode_attention"}',
        "moe_lightning_shm_wait_seconds_total",
        'moe_lightning_handoffs_total{direction="in"}',
    ):
        assert series in attn, series
    gpu = scrape("gpu_expert")
    for series in (
        'moe_lightning_stage_busy_seconds_total{stage="post_attention"}',
        "moe_lightning_sampled_tokens_total",
        "moe_lightning_device_weight_bytes",
    ):
        assert series in gpu, series
    assert "moe_lightning_weight_arena_bytes" in scrape("weight_store")


def test_every_service_serves_health_and_reflection(stack: Stack) -> None:
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

    for name in stack.services:  # the gRPC ones (the HTTP gateway's /health: tests/test_gateway_e2e.py)
        service = SERVICES[name].health
        channel = open_channel(stack.addresses[name])
        try:
            assert health_status(channel, "") == 1  # live
            assert health_status(channel, service) == 1  # ready
            listed = set(ProtoReflectionDescriptorDatabase(channel).get_services())
            assert {service, "grpc.health.v1.Health"} <= listed, name
        finally:
            channel.close()


def test_workers_report_their_calibrated_roofs(stack: Stack) -> None:
    from moe_lightning.api.cpu_attention.v1 import cpu_attention_pb2, cpu_attention_pb2_grpc
    from moe_lightning.api.gpu_expert.v1 import gpu_expert_pb2, gpu_expert_pb2_grpc

    gpu_ch, cpu_ch = open_channel(stack.addresses["gpu_expert"]), open_channel(stack.addresses["cpu_attention"])
    try:
        g = gpu_expert_pb2_grpc.GpuExpertStub(gpu_ch).Describe(gpu_expert_pb2.DescribeRequest()).measurements
        c = cpu_attention_pb2_grpc.CpuAttentionStub(cpu_ch).Describe(cpu_attention_pb2.DescribeRequest()).measurements
    finally:
        gpu_ch.close()
        cpu_ch.close()
    assert g.matmul_flops > 1e8 and g.weight_stream_bandwidth > 1e7 and g.shared_host_device
    assert c.attention_bandwidth > 1e7 and c.memory_bytes > 1e9


def test_the_orchestrator_serves_without_torch(stack: Stack, client: GenerationClient) -> None:
    """The orchestrator plans, schedules and detokenizes; it computes nothing, so it does not load
    torch (a stack starts a torch import faster: docs/architecture.md, "Repository layout"). Checked
    in the running process after it has served, not by importing its modules here."""
    assert client.generate(Prompt(token_ids=PROMPTS[0], max_new_tokens=2, ignore_eos=True)).completion_tokens == 2
    maps = Path(f"/proc/{stack.procs['orchestrator'].pid}/maps").read_text()
    assert "libtorch" not in maps
    assert "libtorch" in Path(f"/proc/{stack.procs['gpu_expert'].pid}/maps").read_text()  # the check can see it


def test_a_weight_store_on_its_copy_never_loads_torch(make_stack: Callable[..., Stack], tmp_path: Path) -> None:
    """Filling the arena from the on-disk copy is a file copy into shared memory and serving pages is
    gRPC, so a weight store started on a copy never loads torch: ~1.3 s of CPU less at every start,
    beside the other services' imports of torch on the same cores. The first start converts (torch)."""
    cache = tmp_path / "arena"
    first = make_stack(cache_dir=cache)
    deadline = time.monotonic() + 60
    while not (list(cache.glob("*.arena")) and list(cache.glob("*.json"))):  # written once serving
        assert time.monotonic() < deadline, "the arena copy was never written"
        time.sleep(0.05)
    first.stop()
    second = make_stack(cache_dir=cache)
    with GenerationClient(second.api_address, timeout=120) as client:
        done = client.generate(Prompt(token_ids=PROMPTS[0], max_new_tokens=2, ignore_eos=True))
    assert done.completion_tokens == 2  # gpu_expert has mapped the pages the store serves
    assert "arena_mapped_from_copy" in (second.config.log_dir / "weight_store.log").read_text()
    assert "libtorch" not in Path(f"/proc/{second.procs['weight_store'].pid}/maps").read_text()
    assert "libtorch" in Path(f"/proc/{second.procs['gpu_expert'].pid}/maps").read_text()  # the check can see it
