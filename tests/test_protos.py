"""Generated protobuf code is committed; it must equal what protoc makes from protos/ now."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
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


def test_the_package_asks_for_what_the_generated_code_checks() -> None:
    """The generated code refuses runtimes older than its stamps at import; pyproject's floors are those
    stamps, and its grpcio-tools pin is the protoc that made them (so `make proto` and this file's
    first test regenerate the same bytes on a fresh machine, whatever gRPC released since)."""
    api = ROOT / "moe_lightning" / "api"

    def stamps(pattern: str, glob: str) -> set[str]:
        return {m[1] for p in api.rglob(glob) if (m := re.search(pattern, p.read_text()))}

    grpc = stamps(r"GRPC_GENERATED_VERSION = '([\d.]+)'", "*_pb2_grpc.py")
    protobuf = stamps(r"# Protobuf Python Version: ([\d.]+)", "*_pb2.py")
    assert len(grpc) == 1 and len(protobuf) == 1, (grpc, protobuf)  # one protoc made them all
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    deps = project["dependencies"] + project["optional-dependencies"]["dev"]
    (grpc_version,), (protobuf_version,) = grpc, protobuf
    assert f"grpcio>={grpc_version}" in deps
    assert f"protobuf>={protobuf_version}" in deps
    assert f"grpcio-tools=={grpc_version}" in deps


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
