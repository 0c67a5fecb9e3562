from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from moe_lightning.demo_model import write_demo_model

    return write_demo_model(tmp_path_factory.mktemp("tiny"), "tiny", seed=0, progress=False)
