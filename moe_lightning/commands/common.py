"""Flags and helpers shared by the generate and run commands."""

from __future__ import annotations

import argparse
from pathlib import Path

from moe_lightning.flags import add_batch_flags, add_kernel_flags, add_link_flags, add_quantize_flags, positive_int


def token_ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated token ids, got {text!r}") from None


def add_sampling_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate per prompt")
    p.add_argument("--ignore-eos", action="store_true", help="keep generating past the EOS token")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=0, help="sample from the k most likely tokens; 0 = off")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass in (0, 1]")
    p.add_argument("--seed", type=int, default=None, help="seed of the sampling stream (reproducible)")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")


def add_client_flags(p: argparse.ArgumentParser) -> None:
    """How to reach a stack whose public API requires TLS and/or a token."""
    p.add_argument("--tls-ca", type=Path, default=None, help="PEM root certificate to verify the server's TLS cert")
    p.add_argument("--auth-token", default=None, help="bearer token (or set MOE_LIGHTNING_AUTH_TOKEN)")
    p.add_argument(
        "--allow-insecure-token",
        action="store_true",
        help="send --auth-token without TLS to a non-loopback address (refused otherwise: anyone on the path reads it)",
    )


def add_placement_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--device-kv-memory", default=None, help="a KV cache in gpu_expert, so attention may run on the device"
    )
    p.add_argument("--attention-placement", default="auto", choices=["auto", "cpu", "gpu"], help="auto: the HRM picks")
    p.add_argument(
        "--experts-placement",
        default="auto",
        choices=["auto", "gpu", "cpu"],
        help="non-resident experts streamed to the device (gpu) or computed on the host (cpu); auto: the HRM picks",
    )


def add_stack_flags(p: argparse.ArgumentParser) -> None:
    """How `up` and `run --model` start the services."""
    p.add_argument("--device", default="cpu", help="cpu or cuda for gpu_expert")
    p.add_argument(
        "--gpus",
        type=positive_int,
        default=1,
        help="gpu_expert's tensor-parallel ranks, one per device, each with its own --device-memory "
        "(docs/parallel.md; on --device cpu the ranks share the cores)",
    )
    p.add_argument("--device-memory", default=None, help="gpu_expert's weight budget per device, e.g. 16GiB")
    p.add_argument(
        "--kv-cache-memory",
        default="2GiB",
        help="host memory for cpu_attention's KV cache; --kv-dtype decides how many tokens fit",
    )
    p.add_argument(
        "--kv-dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16", "float16"],
        help="dtype of cpu_attention's KV cache (attention computes in fp32 over it); auto: the weights' dtype",
    )
    add_placement_flags(p)
    add_link_flags(p)
    p.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16", "float16"],
        help="dtype of the weights in the arena (and on the device); auto: float32 with --device cpu, else the "
        "checkpoint's 16-bit dtype (bfloat16 for a float32 checkpoint)",
    )
    add_quantize_flags(p)
    add_kernel_flags(p)
    add_batch_flags(p)
    p.add_argument("--run-id", default=None, help="names the shared-memory segments (default: per process)")
    p.add_argument("--cache-dir", default=None, help="where the weight store keeps its converted copy")
    p.add_argument("--log-dir", default=None, help="write each service's log to DIR/<service>.log")
