"""The weight store process: the arena equals the checkpoint; a restart maps the converted copy; a
successor of a killed one adopts its arena."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from moe_lightning.api.weight_store.v1 import weight_store_pb2, weight_store_pb2_grpc
from moe_lightning.arena import ArenaLayout, weights_from_arena
from moe_lightning.checkpoint import load_model_weights
from moe_lightning.service.convert import layout_from_pb, spec_from_pb
from moe_lightning.service.names import WEIGHT_STORE as SERVICE
from moe_lightning.service.upstream import health_status, open_channel
from moe_lightning.shm.segment import Segment, list_segments

from processes import run_weight_store


def start(model: Path, cache: Path, run: str, sock: Path, log: Path, *extra: str) -> tuple[subprocess.Popen, list[int]]:
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "services.weight_store",
            "--model",
            str(model),
            "--cache-dir",
            str(cache),
            "--run-id",
            run,
            "--address",
            f"unix://{sock}",
            "--no-progress",
            *extra,
        ],
        stdout=log.open("ab"),
        stderr=subprocess.STDOUT,
    )
    channel = open_channel(f"unix://{sock}")
    seen: list[int] = []
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and (not seen or seen[-1] != 1):
        status = health_status(channel, SERVICE, timeout=0.5)
        if status is not None and (not seen or seen[-1] != status):
            seen.append(status)
        assert proc.poll() is None, log.read_text()
        time.sleep(0.02)
    channel.close()
    return proc, seen


def manifest(sock: Path) -> weight_store_pb2.GetManifestResponse:
    channel = open_channel(f"unix://{sock}")
    try:
        return weight_store_pb2_grpc.WeightStoreStub(channel).GetManifest(weight_store_pb2.GetManifestRequest())
    finally:
        channel.close()


def test_arena_matches_checkpoint_and_restart_maps_the_copy(tiny_model: Path, tmp_path: Path) -> None:
    run = f"ws{os.getpid()}"
    sock = tmp_path / "ws.sock"
    cache = tmp_path / "cache"
    proc, seen = start(tiny_model, cache, run, sock, tmp_path / "ws.log")
    try:
        assert seen[-1] == 1
        first = manifest(sock)
        assert not first.from_cache and first.load_seconds > 0
        spec = spec_from_pb(first.model)
        layout = layout_from_pb(list(first.pages), first.region_bytes)
        # page-aligned for DMA: every page but an expert's later parts, which follow in its one range
        assert all(p.offset % 4096 == 0 for n, p in layout.pages.items() if not n.endswith(".w2"))
        assert all(p.offset % 64 == 0 for p in layout.pages.values())
        assert len([n for n in layout.pages if ".experts." in n]) == 2 * spec.num_layers * spec.num_experts
        arena = Segment.attach(first.region)
        mapped = weights_from_arena(arena.bytes(), layout, spec)
        ref = load_model_weights(tiny_model, spec, progress=False)
        torch.testing.assert_close(mapped.layers[1].experts[2].w13, ref.layers[1].experts[2].w13, rtol=0, atol=0)
        torch.testing.assert_close(mapped.layers[0].wqkv, ref.layers[0].wqkv, rtol=0, atol=0)
        torch.testing.assert_close(mapped.lm_head, ref.lm_head, rtol=0, atol=0)
        del mapped
        arena.close()
        deadline = time.monotonic() + 30  # the copy is written in the background after SERVING
        while not list(cache.glob("*.json")) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert list(cache.glob("*.arena"))
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    assert list_segments(run) == []

    proc, seen = start(tiny_model, cache, run, sock, tmp_path / "ws.log")
    try:
        second = manifest(sock)
        assert second.from_cache and second.checkpoint_key == first.checkpoint_key
        assert [p.name for p in second.pages] == [p.name for p in first.pages]
        arena = Segment.attach(second.region)
        again = weights_from_arena(arena.bytes(), layout_from_pb(list(second.pages), second.region_bytes), spec)
        torch.testing.assert_close(again.layers[1].experts[2].w13, ref.layers[1].experts[2].w13, rtol=0, atol=0)
        del again
        arena.close()
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    assert list_segments(run) == []


def test_a_killed_store_is_succeeded_by_one_that_adopts_its_arena(tiny_model: Path, tmp_path: Path) -> None:
    """gpu_expert keeps the arena mapped across a weight store crash; the successor takes that same
    memory over (no second copy in host memory, no load), unless the checkpoint or dtype differ."""
    run = f"wsa{os.getpid()}"
    sock = tmp_path / "ws.sock"
    proc, _ = start(tiny_model, tmp_path / "cache", run, sock, tmp_path / "ws.log", "--no-cache")
    first = manifest(sock)
    held = Segment.attach(first.region)  # as gpu_expert holds it
    proc.kill()
    proc.wait(30)
    proc, _ = start(tiny_model, tmp_path / "cache", run, sock, tmp_path / "ws.log", "--no-cache")
    try:
        second = manifest(sock)
        assert second.adopted and not second.from_cache and second.region != first.region
        arenas = [n for n in list_segments(run) if n.endswith(".arena")]
        assert arenas == [second.region.lstrip("/")]  # one arena in host memory, under the new owner
        new = Segment.attach(second.region)
        byte = int(held.bytes()[-1])
        held.bytes()[-1] = (byte + 1) % 256  # one memory: a write through the old mapping shows
        assert int(new.bytes()[-1]) == (byte + 1) % 256
        held.bytes()[-1] = byte
        new.close()
        proc.kill()  # and again: the successor's successor adopts it too
        proc.wait(30)
        proc, _ = start(tiny_model, tmp_path / "cache", run, sock, tmp_path / "ws.log", "--no-cache")
        assert manifest(sock).adopted
        proc.kill()
        proc.wait(30)
        # another dtype: not the same arena; the leftover is swept, a new one is loaded
        proc, _ = start(
            tiny_model, tmp_path / "cache", run, sock, tmp_path / "ws.log", "--no-cache", "--dtype", "bfloat16"
        )
        third = manifest(sock)
        assert not third.adopted and third.load_seconds > 0
        assert [n for n in list_segments(run) if ".arena" in n] == [
            third.region.lstrip("/"),
            third.region.lstrip("/") + "-ready",
        ]
    finally:
        held.close()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    assert list_segments(run) == []


def _truncate(d: Path) -> None:
    data = (d / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(data[: len(data) // 3])


def _remove_weights(d: Path) -> None:
    (d / "model.safetensors").unlink()


def _wrong_shapes(d: Path) -> None:
    import json

    config = json.loads((d / "config.json").read_text())
    config["intermediate_size"] *= 2  # the tensors on disk no longer match what the config says
    (d / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (_truncate, "truncated safetensors file"),
        (_remove_weights, "no model.safetensors"),
        (_wrong_shapes, "has shape"),
    ],
)
def test_bad_checkpoint_fails_at_start_and_leaves_nothing(
    tiny_model: Path, tmp_path: Path, damage: Callable[[Path], None], message: str
) -> None:
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(tiny_model, bad)
    damage(bad)
    run = f"wsbad{os.getpid()}{damage.__name__}"
    r = run_weight_store(bad, run, tmp_path / "b.sock", timeout=60)
    assert r.returncode == 1
    assert message in r.stderr, r.stderr[-2000:]
    assert list_segments(run) == []


def test_a_tokenizer_of_another_model_fails_at_start(tiny_model: Path, tmp_path: Path) -> None:
    import shutil

    from moe_lightning.demo_model import build_tokenizer
    from moe_lightning.spec import ModelSpec

    bad = tmp_path / "badtok"
    shutil.copytree(tiny_model, bad)
    vocab = ModelSpec.from_pretrained(bad).vocab_size
    build_tokenizer(vocab * 4).save(str(bad / "tokenizer.json"))
    run = f"wstok{os.getpid()}"
    cmd = [sys.executable, "-m", "services.weight_store", "--model", str(bad), "--run-id", run, "--no-cache"]
    r = subprocess.run(
        [*cmd, "--address", f"unix://{tmp_path / 't.sock'}", "--no-progress"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 1
    assert f"has {vocab * 4} tokens but the model's vocabulary has {vocab}" in r.stderr
    assert list_segments(run) == []


def test_the_expert_format_is_part_of_the_arena_and_its_copy(tiny_model: Path, tmp_path: Path) -> None:
    """--quantize int8 lays out int8 pages (one range per expert); its converted copy is keyed by the
    format: a restart in int8 maps it, one in the model's dtype converts the checkpoint again."""
    run = f"wsq{os.getpid()}"
    sock = tmp_path / "ws.sock"
    cache = tmp_path / "cache"
    keys = {}
    for fmt, from_cache in (("int8", False), ("int8", True), ("none", False)):
        proc, _ = start(tiny_model, cache, run, sock, tmp_path / "ws.log", "--quantize", fmt)
        try:
            m = manifest(sock)
            assert m.from_cache == from_cache, fmt
            layout = layout_from_pb(list(m.pages), m.region_bytes)
            assert layout.expert_scheme().format.value == fmt
            keys.setdefault(fmt, m.checkpoint_key)
            assert m.checkpoint_key == keys[fmt]
            if fmt == "int8":
                page = layout.pages["layers.0.experts.1.w13.qweight"]
                assert page.dtype == "int8" and page.offset % 4096 == 0
                fp32 = ArenaLayout.for_spec(spec_from_pb(m.model), "float32").expert_page_bytes(0)
                assert layout.expert_page_bytes(0) < fp32 / 3.5  # int8 and its scales, against fp32
            deadline = time.monotonic() + 30
            while len(list(cache.glob("*.json"))) < len(keys) and time.monotonic() < deadline:
                time.sleep(0.1)
        finally:
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(30) == 0
    assert keys["int8"] != keys["none"]
    assert list_segments(run) == []
