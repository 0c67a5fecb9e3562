"""What the check runs on: GPU, versions, and which of our imports fail (a missing wheel, or a grpcio
or protobuf older than the generated code)."""

from __future__ import annotations

import importlib
import os
import platform
import shutil
from importlib.metadata import PackageNotFoundError, version
from typing import Any

import torch

from bench.gpucheck import log

# Modules a service imports; a failure here names the wheel to fetch (see gpu_check.sh).
IMPORTS = (
    "structlog",
    "posix_ipc",
    "grpc_health.v1.health",
    "grpc_reflection.v1alpha.reflection",
    "prometheus_client",
    "pyarrow",
    "tqdm",
    "moe_lightning.api.generation.v1.generation_pb2_grpc",  # fails on a grpcio/protobuf older than its gencode
    "services.gpu_expert.server",
    "services.cpu_attention.server",
    "services.weight_store.server",
    "orchestrator.server",
)
DISTRIBUTIONS = ("torch", "transformers", "accelerate", "safetensors", "tokenizers", "grpcio", "protobuf", "structlog")


def environment() -> dict[str, Any]:
    """What ran where: GPU, versions, and which service imports fail."""
    env: dict[str, Any] = {"python": platform.python_version(), "cpus": os.cpu_count(), "cuda": torch.version.cuda}
    versions = {}
    for dist in DISTRIBUTIONS:
        try:
            versions[dist] = version(dist)
        except PackageNotFoundError:
            versions[dist] = None
    env["versions"] = versions
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        env["gpu"] = {
            "name": props.name,
            "memory_bytes": props.total_memory,
            "capability": f"{props.major}.{props.minor}",
        }
    shm = shutil.disk_usage("/dev/shm")
    env["dev_shm"] = {"total_bytes": shm.total, "free_bytes": shm.free}
    errors = []
    for mod in IMPORTS:
        try:
            importlib.import_module(mod)
        except Exception as exc:  # any import-time failure is a finding, not a crash of the check
            errors.append(f"{mod}: {type(exc).__name__}: {exc}")
    env["import_errors"] = errors
    log(f"{env.get('gpu', {}).get('name', 'no GPU')}, torch {torch.__version__}, {versions}")
    return env
