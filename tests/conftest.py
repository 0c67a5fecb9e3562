from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

from reference import E2E_CONFIG, E2E_PROMPTS, load_hf, save_hf_mixtral

# Hermetic: measured roofs and converted arenas go to a directory of this session's own, never the
# user's ~/.cache, so no test depends on (or leaves behind) what another run measured. Set before any
# service starts: they inherit it (the services' --profile-cache and the weight store's --cache-dir).
_CACHE_ROOT = Path(tempfile.mkdtemp(prefix="moe-lightning-test-cache-"))
os.environ["MOE_LIGHTNING_PROFILE_CACHE"] = str(_CACHE_ROOT / "profiles")
os.environ["MOE_LIGHTNING_CACHE_DIR"] = str(_CACHE_ROOT / "arena")


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
