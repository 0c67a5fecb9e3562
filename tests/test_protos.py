"""Generated protobuf code is committed; it must equal what protoc makes from protos/ now."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_generated_code_is_up_to_date(tmp_path: Path) -> None:
    protos = sorted(str(p.relative_to(ROOT / "protos")) for p in (ROOT / "protos").rglob("*.proto"))
    subprocess.run(
        [
            sys.executable,
            "-m",
            "grpc_tools.protoc",
            "-Iprotos",
            f"--python_out={tmp_path}",
            f"--grpc_python_out={tmp_path}",
            f"--pyi_out={tmp_path}",
            *protos,
        ],
        cwd=ROOT / "protos" / "..",
        check=True,
    )
    generated = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*.py*"))
    assert generated, "protoc produced nothing"
    stale = [str(p) for p in generated if (ROOT / p).read_bytes() != (tmp_path / p).read_bytes()]
    assert not stale, f"regenerate with `make proto`: {stale}"
    committed = sorted(p.relative_to(ROOT) for p in (ROOT / "moe_lightning" / "api").rglob("*_pb2*.py*"))
    assert committed == generated


def test_proto_conventions() -> None:
    """Versioned packages mirroring folders, *_UNSPECIFIED = 0 enums, one request/response per RPC."""
    import re

    for path in (ROOT / "protos").rglob("*.proto"):
        text = path.read_text()
        rel = path.relative_to(ROOT / "protos").parent
        assert f"package {str(rel).replace('/', '.')};" in text, path
        assert rel.name == "v1"
        for enum, body in re.findall(r"enum (\w+) \{([^}]*)\}", text):
            first = re.search(r"(\w+) = 0;", body)
            assert first and first[1].endswith("_UNSPECIFIED"), enum
        rpcs = re.findall(r"rpc (\w+)\((\w+)\) returns \((?:stream )?(\w+)\)", text)
        for name, req, resp in rpcs:
            assert req == f"{name}Request" and resp == f"{name}Response", name
