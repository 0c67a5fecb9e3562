"""Where calibrated roofs are kept between runs, and how a cache that cannot be used is survived."""

from __future__ import annotations

import os
from pathlib import Path

import structlog

PROFILE_CACHE_ENV = "MOE_LIGHTNING_PROFILE_CACHE"


def profile_cache_dir() -> Path:
    """Where measured roofs are kept between runs: $MOE_LIGHTNING_PROFILE_CACHE (the services'
    --profile-cache), else ~/.cache/moe-lightning/profiles. The test suite points it at a fresh
    temporary directory, so no test depends on what an earlier run measured."""
    return Path(os.environ.get(PROFILE_CACHE_ENV) or Path.home() / ".cache" / "moe-lightning" / "profiles")


# The cache only saves a re-measurement: a cache that cannot be read or written (a container user whose
# HOME is /nonexistent, a read-only or foreign directory) is a warning, never a failed start.


def cache_file(cache_dir: Path | None, name: str) -> Path | None:
    try:
        return (cache_dir or profile_cache_dir()) / name
    except RuntimeError as exc:  # Path.home(): no HOME and no passwd entry
        cache_warning("profile_cache_unavailable", None, exc)
        return None


def cache_warning(event: str, path: Path | None, exc: BaseException) -> None:
    structlog.get_logger().warning(
        event,
        path=None if path is None else str(path),
        error=f"{type(exc).__name__}: {exc}",
        hint=f"set --profile-cache or ${PROFILE_CACHE_ENV} to a writable directory",
    )


def read_cache(path: Path | None) -> str | None:
    if path is None:
        return None
    try:
        return path.read_text() if path.is_file() else None
    except (OSError, UnicodeDecodeError) as exc:
        cache_warning("profile_cache_read_failed", path, exc)
        return None


def write_cache(path: Path | None, text: str) -> None:
    if path is None:
        return
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(text)
        tmp.replace(path)  # atomic: a concurrent reader never sees half a file
    except OSError as exc:
        cache_warning("profile_cache_write_failed", path, exc)
        try:
            tmp.unlink(missing_ok=True)
        except OSError:
            pass
