"""A cache that cannot be read or written (issue 14, item 11): the Docker image runs as `nobody` with
HOME=/nonexistent, and the calibration cache write used to raise and stop gpu_expert and cpu_attention
at start. Now it is a warning, the measurements are returned, and the image points every cache at /cache."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from moe_lightning.hrm.calibrate import PROFILE_CACHE_ENV, cached_measurements
from moe_lightning.hrm.roofs import Measurements

ROOT = Path(__file__).resolve().parents[1]
NOBODY = 65534


class Counting:
    def __init__(self) -> None:
        self.calls = 0

    def __call__(self) -> Measurements:
        self.calls += 1
        return Measurements(matmul_flops=1e9, attention_bandwidth=2e9, source="test")


def test_a_cache_dir_that_cannot_be_created_is_a_warning(tmp_path: Path) -> None:
    """A path under a regular file: mkdir fails even as root."""
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    measure = Counting()
    with capture_logs() as logs:
        m = cached_measurements("svc", measure, cache_dir=blocker / "profiles")
        again = cached_measurements("svc", measure, cache_dir=blocker / "profiles")
    assert m == again == Measurements(matmul_flops=1e9, attention_bandwidth=2e9, source="test")
    assert measure.calls == 2  # nothing cached, measured again, never raised
    warnings = [e for e in logs if e["event"] == "profile_cache_write_failed"]
    assert len(warnings) == 2 and all(e["log_level"] == "warning" for e in warnings)
    assert str(blocker / "profiles") in warnings[0]["path"] and PROFILE_CACHE_ENV in warnings[0]["hint"]


def test_a_damaged_or_unreadable_cache_file_is_measured_again(tmp_path: Path) -> None:
    measure = Counting()
    first = cached_measurements("svc", measure, cache_dir=tmp_path)
    (cached,) = tmp_path.glob("*.json")
    cached.write_text(json.dumps([1, 2]))  # valid JSON, not our fields
    assert cached_measurements("svc", measure, cache_dir=tmp_path) == first and measure.calls == 2
    cached.write_bytes(b"\xff\xfe{")  # not UTF-8: reading it fails
    with capture_logs() as logs:
        assert cached_measurements("svc", measure, cache_dir=tmp_path) == first and measure.calls == 3
    assert [e["event"] for e in logs] == ["profile_cache_read_failed"]
    assert json.loads(cached.read_text())["matmul_flops"] == 1e9  # rewritten whole
    cached.unlink()
    cached.mkdir()  # a directory where the file goes: replacing it fails
    with capture_logs() as logs:
        assert cached_measurements("svc", measure, cache_dir=tmp_path) == first and measure.calls == 4
    assert [e["event"] for e in logs] == ["profile_cache_write_failed"]
    assert [p.name for p in tmp_path.iterdir()] == [cached.name]  # no temporary file left behind


def _as_nobody(cache_dir: Path | None) -> dict:
    """Runs cached_measurements in a forked child that is `nobody` with HOME=/nonexistent, as in the image."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: never return into pytest
        code = 1
        try:
            os.close(r)
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            os.environ["HOME"] = "/nonexistent"
            os.environ.pop(PROFILE_CACHE_ENV, None)
            with capture_logs() as logs:
                m = cached_measurements("svc", Counting(), cache_dir=cache_dir)
            out = {"flops": m.matmul_flops, "events": [(e["event"], e["log_level"]) for e in logs]}
            os.write(w, json.dumps(out).encode())
            code = 0
        except BaseException as exc:  # reported to the parent through the pipe
            os.write(w, json.dumps({"error": repr(exc)}).encode())
        finally:
            os._exit(code)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        data = f.read()
    _, status = os.waitpid(pid, 0)
    result = json.loads(data)
    assert os.waitstatus_to_exitcode(status) == 0, result
    return result


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to become nobody in a child")
@pytest.mark.parametrize("where", ["home", "read-only"])
def test_as_nobody_without_a_home_the_measurements_come_back_with_a_warning(tmp_path: Path, where: str) -> None:
    cache_dir = None  # "home": the default, ~/.cache/... under HOME=/nonexistent
    if where == "read-only":  # nobody's own directory, mode 0500; under /tmp, since pytest's tmp_path is 0700 root
        cache_dir = Path(tempfile.mkdtemp(prefix="moe-ro-cache-", dir="/tmp"))
        os.chown(cache_dir, NOBODY, NOBODY)
        cache_dir.chmod(0o500)
    try:
        result = _as_nobody(cache_dir)
    finally:
        if cache_dir is not None:
            shutil.rmtree(cache_dir)
    assert result["flops"] == 1e9
    assert ("profile_cache_write_failed", "warning") in [tuple(e) for e in result["events"]]


def test_the_image_points_every_cache_at_the_volume(monkeypatch: pytest.MonkeyPatch) -> None:
    text = (ROOT / "deploy" / "Dockerfile").read_text()
    env = dict(
        line.strip().rstrip("\\").strip().removeprefix("ENV ").split("=", 1)
        for line in text.splitlines()
        if "MOE_LIGHTNING_" in line and "=" in line and not line.lstrip().startswith("#")
    )
    assert env[PROFILE_CACHE_ENV].startswith("/cache/")
    assert env["MOE_LIGHTNING_CACHE_DIR"].startswith("/cache/")
    assert "USER nobody" in text and "chown -R nobody" in text
    # the variable the image sets is the one the weight store's --cache-dir reads
    from services.weight_store.server import build_parser

    monkeypatch.setenv("MOE_LIGHTNING_CACHE_DIR", env["MOE_LIGHTNING_CACHE_DIR"])
    assert build_parser().parse_args(["--model", "m"]).cache_dir == Path(env["MOE_LIGHTNING_CACHE_DIR"])


def test_the_weight_store_starts_without_a_home(monkeypatch: pytest.MonkeyPatch) -> None:
    """A container user without a passwd entry: Path.home() raises; the parser used to call it at import."""
    from services.weight_store import server

    def no_home() -> Path:
        raise RuntimeError("Could not determine home directory.")

    monkeypatch.delenv("MOE_LIGHTNING_CACHE_DIR", raising=False)
    monkeypatch.setattr(Path, "home", staticmethod(no_home))
    assert server.build_parser().parse_args(["--model", "m"]).cache_dir is None
    with capture_logs() as logs:
        assert server.default_cache_dir() is None
    assert logs[0]["event"] == "arena_cache_disabled" and logs[0]["log_level"] == "warning"
