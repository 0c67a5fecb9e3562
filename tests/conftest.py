from __future__ import annotations

import itertools
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parents[1]))  # this checkout, not what an editable install points at

from moe_lightning.config.stack import StackConfig
from moe_lightning.launcher import Stack

from reference import E2E_CONFIG, E2E_PROMPTS, load_hf, save_hf_mixtral

# the services a test starts run this checkout's code too
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [sys.path[0], os.environ.get("PYTHONPATH")]))

# Hermetic: measured roofs and converted arenas go to a directory of this session's own, never the
# user's ~/.cache, so no test depends on (or leaves behind) what another run measured. Set before any
# service starts: they inherit it (the services' --profile-cache and the weight store's --cache-dir).
_CACHE_ROOT = Path(tempfile.mkdtemp(prefix="moe-lightning-test-cache-"))
os.environ["MOE_LIGHTNING_PROFILE_CACHE"] = str(_CACHE_ROOT / "profiles")
os.environ["MOE_LIGHTNING_CACHE_DIR"] = str(_CACHE_ROOT / "arena")
# the native kernels' build; MOE_LIGHTNING_TEST_NATIVE_DIR (never set by CI) keeps one across runs
# while iterating on a few tests: the build is ~50 s of a 2-core machine's every pytest start
os.environ["MOE_LIGHTNING_NATIVE_DIR"] = os.environ.get("MOE_LIGHTNING_TEST_NATIVE_DIR") or str(_CACHE_ROOT / "native")


def pytest_sessionstart(session: pytest.Session) -> None:
    """The native kernels built once, before any service starts (each would otherwise wait on the
    first one's build), both at once; a machine that cannot build them runs the PyTorch path, as
    users' do. Not for --collect-only, which runs nothing (the GPU check's dry run collects its CUDA
    tests: a minute of builds for nothing)."""
    if session.config.option.collectonly:
        return
    from moe_lightning.native import build_all

    build_all()


def pytest_unconfigure(config: pytest.Config) -> None:
    shutil.rmtree(_CACHE_ROOT, ignore_errors=True)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from moe_lightning.demo_model import write_demo_model

    return write_demo_model(tmp_path_factory.mktemp("tiny"), "tiny", seed=0, progress=False)


@pytest.fixture(scope="session")
def hf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_hf_mixtral(tmp_path_factory.mktemp("hf_e2e"), seed=3, **E2E_CONFIG)


@pytest.fixture(scope="session")
def reference(hf_dir: Path) -> dict[int, list[int]]:
    hf = load_hf(hf_dir)
    out = {}
    for i, p in enumerate(E2E_PROMPTS):
        ids = hf.generate(
            torch.tensor([p]),
            attention_mask=torch.ones(1, len(p), dtype=torch.long),
            max_new_tokens=14,
            do_sample=False,
            pad_token_id=0,
        )
        out[i] = ids[0, len(p) :].tolist()
    return out


# What the end-to-end stacks share; a test overrides any StackConfig field by keyword.
STACK_DEFAULTS: dict[str, Any] = dict(port=0, kv_cache_memory="32MiB", max_batch_size=8)
_RUN_IDS = itertools.count()


class StackFactory:
    """Called with StackConfig fields as keywords, it builds a Stack of STACK_DEFAULTS + those -- on the
    session's `hf_dir` model unless `model` is given, with a run id of its own and a fresh log directory
    -- and starts it, waiting up to `timeout` s for SERVING (`start=False`: not started, for a test of a
    failing start or of a start in stages). `close()` stops every stack it made (a test may stop one
    sooner), then checks that none left a shared-memory segment behind."""

    def __init__(self, request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> None:
        self._request = request
        self._tmp = tmp_path_factory
        self.stacks: list[Stack] = []

    def __call__(self, *, start: bool = True, timeout: float = 120.0, **overrides: Any) -> Stack:
        if "model" not in overrides:
            overrides["model"] = self._request.getfixturevalue("hf_dir")
        run_id = overrides.setdefault("run_id", f"t{os.getpid()}-{next(_RUN_IDS)}")
        overrides.setdefault("log_dir", self._tmp.mktemp(f"{run_id}-logs"))
        stack = Stack(StackConfig(**{**STACK_DEFAULTS, **overrides}))
        self.stacks.append(stack)
        if start:
            stack.start(timeout=timeout)  # on failure it stops what did start, then raises
        return stack

    def close(self) -> None:
        errors = []
        for stack in reversed(self.stacks):
            try:
                stack.stop()  # idempotent: a test may stop its stack early to look at what it left
            except Exception as exc:  # still stop the others
                errors.append(exc)
        if errors:
            raise errors[0]
        leaked = {s.config.run_id: s.leaked_segments() for s in self.stacks}
        assert not any(leaked.values()), f"segments left behind: {leaked}"


def _stack_factory(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[StackFactory]:
    factory = StackFactory(request, tmp_path_factory)
    yield factory
    factory.close()


@pytest.fixture
def make_stack(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[StackFactory]:
    """Started stacks for one test, all stopped when it ends (pass or fail): `make_stack(**overrides)`."""
    yield from _stack_factory(request, tmp_path_factory)


@pytest.fixture(scope="module")
def make_module_stack(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[StackFactory]:
    """The same, for a stack that a module's tests share: stopped when the module's tests are done."""
    yield from _stack_factory(request, tmp_path_factory)
