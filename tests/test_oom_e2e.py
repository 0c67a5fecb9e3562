"""A step that runs out of memory on gpu_expert's device answers RESOURCE_EXHAUSTED (saying how big
the step was) and the service keeps serving: no restart, the next request is answered.

On a CPU "device" the shortage is real: gpu_expert's address space is capped (RLIMIT_AS, set from
outside with prlimit, as a container's limit would be) at what it maps plus 128 MiB, and a batch
whose head logits need more than that is sent. A model with a wide vocabulary and a narrow body
makes those logits the one large allocation (1,024 sequences x 65,536 tokens x 4 bytes = 256 MiB).
"""

from __future__ import annotations

import re
import resource
import urllib.request
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest

from moe_lightning.client import GenerationClient, Prompt
from moe_lightning.demo_model import write_demo_model
from moe_lightning.launcher import Stack

WIDE_VOCAB = dict(
    hidden_size=16,
    intermediate_size=32,
    num_hidden_layers=1,
    num_attention_heads=2,
    num_key_value_heads=1,
    num_local_experts=4,
    num_experts_per_tok=2,
    vocab_size=65536,
    max_position_embeddings=64,
)


def _mapped_bytes(pid: int) -> int:
    return int(re.search(r"VmSize:\s+(\d+) kB", Path(f"/proc/{pid}/status").read_text())[1]) * 1024


def test_a_step_out_of_memory_is_resource_exhausted_and_the_service_keeps_serving(
    tmp_path: Path, make_stack: Callable[..., Stack]
) -> None:
    model = write_demo_model(tmp_path / "wide", WIDE_VOCAB, seed=0, progress=False, with_tokenizer=False)
    stack = make_stack(model=model, kv_cache_memory="64MiB", max_batch_size=1024, micro_batch_size=0)
    gpu = stack.procs["gpu_expert"]
    with GenerationClient(stack.api_address, timeout=120) as c:
        want = c.generate(Prompt(token_ids=[5, 6, 7], max_new_tokens=4)).token_ids
        soft, hard = resource.prlimit(gpu.pid, resource.RLIMIT_AS)
        resource.prlimit(gpu.pid, resource.RLIMIT_AS, (_mapped_bytes(gpu.pid) + (128 << 20), hard))
        try:
            with pytest.raises(grpc.RpcError) as err:
                c.batch_generate([Prompt(token_ids=[5 + i % 100, 7], max_new_tokens=3) for i in range(1024)])
        finally:
            resource.prlimit(gpu.pid, resource.RLIMIT_AS, (soft, hard))
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "ran out of memory on cpu" in err.value.details()
        assert "sequences" in err.value.details() and "retry with fewer" in err.value.details()
        assert c.generate(Prompt(token_ids=[5, 6, 7], max_new_tokens=4)).token_ids == want
    assert gpu.poll() is None and stack.procs["gpu_expert"] is gpu and not stack.restarts["gpu_expert"]
    with urllib.request.urlopen(stack.endpoints()["gpu_expert"]["metrics"], timeout=10) as r:
        failed = re.search(r"^moe_lightning_step_out_of_memory_total (\S+)", r.read().decode(), re.M)
    assert failed is not None and float(failed[1]) >= 1
    stack.stop()
    assert stack.leaked_segments() == []
