"""The gRPC full names of the four services, read from the generated descriptors.

They name each service's readiness in grpc.health.v1 and its methods' paths; reading them from the
protos means a renamed package or service cannot leave a stale copy typed somewhere else. Only
deploy/docker-compose.yml still spells them out (YAML cannot import; tests/test_deploy.py checks it
against these).
"""

from __future__ import annotations

from types import ModuleType

from moe_lightning.api.cpu_attention.v1 import cpu_attention_pb2
from moe_lightning.api.generation.v1 import generation_pb2
from moe_lightning.api.gpu_expert.v1 import gpu_expert_pb2
from moe_lightning.api.weight_store.v1 import weight_store_pb2


def full_name(module: ModuleType, service: str) -> str:
    """`service`'s full name as declared in the proto file `module` was generated from."""
    return module.DESCRIPTOR.services_by_name[service].full_name


WEIGHT_STORE = full_name(weight_store_pb2, "WeightStore")
GPU_EXPERT = full_name(gpu_expert_pb2, "GpuExpert")
CPU_ATTENTION = full_name(cpu_attention_pb2, "CpuAttention")
GENERATION = full_name(generation_pb2, "Generation")
