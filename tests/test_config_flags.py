"""Configuration has one home (docs/configuration.md): every flag of every command and service is
declared once, offers the config's choice set, and reads its environment variable as the flag would."""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import os
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

import pytest

from moe_lightning import cli
from moe_lightning.config import choices
from moe_lightning.config.checks import int4_group_size, resolve_group_size
from moe_lightning.config.cpu_attention import CpuAttentionConfig
from moe_lightning.config.flag import Flag
from moe_lightning.config.gateway import GatewayConfig
from moe_lightning.config.gpu_expert import GpuExpertConfig
from moe_lightning.config.orchestrator import OrchestratorConfig
from moe_lightning.config.stack import StackConfig, Wiring
from moe_lightning.config.units import DeviceShare
from moe_lightning.config.weight_store import WeightStoreConfig
from moe_lightning.spec import ModelSpec

SERVICE_PARSERS = {
    "weight_store": ("services.weight_store.server", WeightStoreConfig),
    "cpu_attention": ("services.cpu_attention.server", CpuAttentionConfig),
    "gpu_expert": ("services.gpu_expert.server", GpuExpertConfig),
    "orchestrator": ("orchestrator.server", OrchestratorConfig),
    "gateway": ("gateway.server", GatewayConfig),
}
# the config's value set of each dest that takes one
CHOICE_SETS = {
    "dtype": choices.DTYPE_CHOICES,
    "kv_dtype": choices.KV_DTYPE_CHOICES,
    "quantize": choices.QUANTIZE_CHOICES,
    "attention_placement": choices.ATTENTION_PLACEMENTS,
    "experts_placement": choices.EXPERTS_PLACEMENTS,
    "expert_kernels": choices.EXPERT_KERNELS,
    "tp_backend": choices.TP_BACKENDS,
    "log_level": choices.LOG_LEVELS,
}
REPO = Path(__file__).resolve().parent.parent


def every_parser() -> dict[str, argparse.ArgumentParser]:
    parsers: dict[str, argparse.ArgumentParser] = {}
    for action in cli.build_parser()._actions:
        if isinstance(action, argparse._SubParsersAction):
            parsers |= {f"moe-lightning {name}": p for name, p in action.choices.items()}
    for name, (module, _) in SERVICE_PARSERS.items():
        parsers[name] = importlib.import_module(module).build_parser()
    return parsers


def declaration(action: argparse.Action) -> object:
    """What declared an option: its Flag (one object wherever it is added), else the source line of
    the add_argument call."""
    return getattr(action, "flag", None) or action.declared_at  # type: ignore[attr-defined]


def test_every_flag_is_declared_once_with_the_configs_choices() -> None:
    declared: dict[str, set[object]] = defaultdict(set)
    users: dict[str, list[str]] = defaultdict(list)
    for where, parser in every_parser().items():
        for action in parser._actions:
            if not action.option_strings or action.dest == "help":
                continue
            for option in action.option_strings:
                declared[option].add(declaration(action))
                users[option].append(where)
            if action.dest in CHOICE_SETS:
                assert tuple(action.choices or ()) == CHOICE_SETS[action.dest], (where, action.dest, action.choices)
    twice = {option: sorted(map(str, d)) for option, d in declared.items() if len(d) > 1}
    assert not twice, f"declared more than once: {twice}"
    # what a service and a command share (the stack's options) is a Flag of moe_lightning/config
    crossing = [
        o for o, where in users.items() if set(where) & set(SERVICE_PARSERS) and set(where) - set(SERVICE_PARSERS)
    ]
    assert crossing and all(isinstance(next(iter(declared[o])), Flag) for o in crossing), crossing


def test_no_add_argument_outside_the_config_and_the_commands() -> None:
    """The services declare no flag of their own: their parsers are their configs'."""
    for module in (
        "services/weight_store/server.py",
        "services/cpu_attention/server.py",
        "services/gpu_expert/server.py",
        "orchestrator/server.py",
        "gateway/server.py",
    ):
        assert "add_argument(" not in (REPO / module).read_text(), module


@pytest.mark.parametrize("name", list(SERVICE_PARSERS))
def test_a_service_config_round_trips_through_its_argv(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    for variable in [v for v in os.environ if v.startswith("MOE_LIGHTNING_")]:
        monkeypatch.delenv(variable)
    module, cls = SERVICE_PARSERS[name]
    parser = importlib.import_module(module).build_parser()
    required = [a for a in parser._actions if a.required]
    base = [x for a in required for x in (a.option_strings[0], "unix:///x" if "store" in a.dest else "x")]
    if name == "weight_store":
        base = ["--model", "m"]
    config = cls.from_cli_args(parser.parse_args(base))
    assert cls.from_cli_args(parser.parse_args(config.to_argv())) == config


def test_the_stack_composes_the_five_and_each_reads_back_its_own(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for variable in [v for v in os.environ if v.startswith("MOE_LIGHTNING_")]:
        monkeypatch.delenv(variable)  # the suite's cache directories: the parser would take them as defaults
    stack = StackConfig(
        model=tmp_path,
        device="cpu",
        gpus=2,
        device_memory="25%",
        device_kv_memory="1MiB",
        http_port=0,
        kv_dtype="bfloat16",
        quantize="int4",
        link_bandwidth=2e9,
        micro_batch_size=0,
        auth_token="secret",
    )
    names = stack.services
    assert names == ["weight_store", "cpu_attention", "gpu_expert", "orchestrator", "gateway"]
    wiring = Wiring({n: f"unix:///{n}" for n in names}, dict.fromkeys(names, 0), "float32")
    for name, config in stack.compose(wiring).items():
        module, cls = SERVICE_PARSERS[name]
        argv = config.to_argv()
        assert "secret" not in argv  # the token goes by environment: ps shows argv
        back = cls.from_cli_args(importlib.import_module(module).build_parser().parse_args(argv))
        assert back == dataclasses.replace(config, **{k: None for k in ("auth_token",) if hasattr(config, k)})
    gpu = stack.compose(wiring)["gpu_expert"]
    assert isinstance(gpu, GpuExpertConfig) and gpu.device_memory == DeviceShare(25.0) and gpu.gpus == 2


def test_an_environment_value_outside_the_choices_is_refused_naming_the_variable() -> None:
    env = {**os.environ, "MOE_LIGHTNING_QUANTIZE": "int3"}
    r = subprocess.run(
        [sys.executable, "-m", "moe_lightning.cli", "plan", "--arch", "mixtral-8x7b"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2, r.stderr
    assert "MOE_LIGHTNING_QUANTIZE='int3' (--quantize): must be one of auto, none, int8, int4" in r.stderr


@pytest.mark.parametrize("variable", ["MOE_LIGHTNING_DTYPE", "MOE_LIGHTNING_QUANTIZE", "MOE_LIGHTNING_KV_DTYPE"])
def test_auto_from_the_environment_plans_as_the_default_does(variable: str) -> None:
    """Was a KeyError 'auto' (dtype) and a refusal (quantize): `auto` means the same in every command."""
    argv = [sys.executable, "-m", "moe_lightning.cli", "plan", "--arch", "mixtral-8x7b", "--hardware", "t4", "--json"]
    plain = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    auto = subprocess.run(argv, env={**os.environ, variable: "auto"}, capture_output=True, text=True, timeout=60)
    assert plain.returncode == 0 and auto.returncode == 0, auto.stderr
    assert auto.stdout == plain.stdout


def _spec(hidden: int, intermediate: int) -> ModelSpec:
    return ModelSpec(
        architecture="MixtralForCausalLM",
        vocab_size=64,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=hidden // 4,
        num_experts=4,
        top_k=2,
    )


def test_int4_group_size_defaults_to_the_largest_that_divides_every_width() -> None:
    assert int4_group_size(_spec(256, 512)) == 128
    assert int4_group_size(_spec(192, 384)) == 64  # 128 does not divide 192
    assert int4_group_size(_spec(96, 160)) == 32
    assert int4_group_size(_spec(256, 256), world=4) == 64  # w2's 64 input columns per rank
    assert resolve_group_size(_spec(192, 384), "int4", 32) == 32  # given: kept
    with pytest.raises(ValueError, match="--quantize-group-size -1"):
        int4_group_size(_spec(72, 144))


def test_up_refuses_what_the_services_would_before_starting_any(tiny_model: Path, tmp_path: Path) -> None:
    """Each answer comes in well under a second, with no process started and the services' words."""
    cases = [
        (["--gpus", "3"], "4 attention heads do not divide by 3 ranks"),
        (["--device-memory", "64KiB"], "cannot hold the dense weights"),
        (["--attention-placement", "gpu"], "placement 'gpu' is not available: gpu_expert has no device KV cache"),
        (["--quantize", "int4", "--quantize-group-size", "128"], "group size 128 does not divide the input width"),
        (["--device", "cuda", "--link-bandwidth", "2GB/s"], "--link-bandwidth simulates a host-device link"),
    ]
    for extra, words in cases:
        t0 = time.monotonic()
        r = subprocess.run(
            [
                sys.executable,
                "-m",
                "moe_lightning.cli",
                "up",
                "--model",
                str(tiny_model),
                "--port",
                "0",
                "--http-port",
                "0",
                "--log-dir",
                str(tmp_path / "logs"),
                *extra,
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
        took = time.monotonic() - t0
        assert r.returncode != 0 and words in r.stderr, (extra, r.stderr)
        assert not (tmp_path / "logs").exists() or not any((tmp_path / "logs").iterdir()), extra  # none started
        assert took < 5, (extra, took)  # an interpreter's start included; the refusal itself is milliseconds


@pytest.mark.parametrize(
    ("extra", "words"),
    [
        (["--quantize", "int4", "--quantize-group-size", "128"], "group size 128 does not divide the input width"),
        (["--tensor-parallel", "3"], "4 attention heads do not divide by 3 ranks"),
    ],
)
def test_the_weight_store_alone_refuses_as_the_launcher_does(
    tiny_model: Path, tmp_path: Path, extra: list[str], words: str
) -> None:
    """The same function answers in the service started by hand (deploy/docker-compose.yml starts it so)."""
    from moe_lightning.shm.segment import list_segments

    run = f"wscfg{os.getpid()}{len(extra)}"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "services.weight_store",
            "--model",
            str(tiny_model),
            "--run-id",
            run,
            "--no-cache",
            "--address",
            f"unix://{tmp_path / 'w.sock'}",
            "--no-progress",
            *extra,
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 1 and words in r.stderr, r.stderr[-2000:]
    assert list_segments(run) == []


def test_the_weight_store_picks_and_logs_the_int4_group_size(tiny_model: Path) -> None:
    """The tiny model's hidden size 64: 128 would not divide it, so int4 takes 64, and says so."""
    spec = ModelSpec.from_pretrained(tiny_model)
    assert spec.hidden_size % 128 and int4_group_size(spec) == 64
    stack = StackConfig(model=tiny_model, quantize="int4")
    from moe_lightning.config.checks import check_stack

    check = check_stack(stack)
    assert check.quantize_group_size == 64 and "group size 64" in check.notes[0]


def test_what_the_stack_sets_beats_the_environment_its_children_inherit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`up --quantize auto` under MOE_LIGHTNING_QUANTIZE=int8: the weight store must still run auto,
    and the orchestrator listen where `up` waits for it, though both equal the services' defaults."""
    for variable, value in [("QUANTIZE", "int8"), ("GPUS", "2"), ("ADDRESS", "0.0.0.0:7777"), ("KV_DTYPE", "float16")]:
        monkeypatch.setenv(f"MOE_LIGHTNING_{variable}", value)
    stack = StackConfig(model=tmp_path, port=50051, http_port=8000)
    names = stack.services
    wiring = Wiring(
        {"gateway": "127.0.0.1:8000", "orchestrator": "127.0.0.1:50051"} | {n: f"unix:///{n}" for n in names[:3]},
        dict.fromkeys(names, 0),
        "float32",
    )
    argv = stack.argv(wiring)
    parsed = {
        n: SERVICE_PARSERS[n][1].from_cli_args(
            importlib.import_module(SERVICE_PARSERS[n][0]).build_parser().parse_args(a)
        )
        for n, a in argv.items()
    }
    assert parsed["weight_store"].quantize == "auto" and parsed["weight_store"].tensor_parallel == 1
    assert parsed["gpu_expert"].gpus == 1 and parsed["cpu_attention"].kv_dtype == "auto"
    assert parsed["orchestrator"].address == "127.0.0.1:50051" and parsed["gateway"].address == "127.0.0.1:8000"


def test_a_bad_environment_value_is_only_the_error_of_the_command_that_takes_it() -> None:
    env = {**os.environ, "MOE_LIGHTNING_QUANTIZE": "int3", "MOE_LIGHTNING_LOG_LEVEL": "INFO"}
    r = subprocess.run(
        [sys.executable, "-m", "moe_lightning.cli", "timeline", "--help"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr  # timeline has no --quantize
    from orchestrator.server import build_parser

    with pytest.MonkeyPatch.context() as m:
        m.setenv("MOE_LIGHTNING_LOG_LEVEL", "WARNING")  # any case, as logging takes it
        assert (
            build_parser().parse_args(["--weight-store", "w", "--gpu-expert", "g", "--cpu-attention", "c"]).log_level
            == "warning"
        )
