"""A real Prometheus over a running stack: the deploy config's jobs and rules, pointed at its ports.

The binaries are Debian's `prometheus` package (the server and promtool). `binaries()` finds them, or
installs the package where it may (root with apt-get), or says why not, so a test can skip with that
reason; MOE_LIGHTNING_NO_APT=1 forbids the install. Prometheus' own release binaries are not used:
on the project's machines only package registries are reachable.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import yaml

from moe_lightning.children import free_port
from moe_lightning.launcher import Stack

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "deploy" / "prometheus" / "prometheus.yml"
INSTALL_TIMEOUT = 600.0
# Debian's maintainer scripts start an installed daemon unless policy-rc.d forbids it (exit 101): the
# package's own Prometheus would then listen on :9090 on every interface
_POLICY_RC = Path("/usr/sbin/policy-rc.d")


def binaries(install: bool = True) -> tuple[str, str] | str:
    """(prometheus, promtool) on PATH, installing Debian's package first when allowed and needed;
    else a sentence saying why there are none."""
    found = shutil.which("prometheus"), shutil.which("promtool")
    if found[0] and found[1]:
        return found[0], found[1]
    if not install or os.environ.get("MOE_LIGHTNING_NO_APT"):
        return "Prometheus is not installed (apt-get install prometheus: Debian's package has the server and promtool)"
    if not shutil.which("apt-get") or os.geteuid() != 0:
        return "Prometheus is not installed and this user cannot apt-get install prometheus (root on Debian can)"
    why = _apt_install("prometheus")
    found = shutil.which("prometheus"), shutil.which("promtool")
    if found[0] and found[1]:
        return found[0], found[1]
    return f"apt-get install prometheus failed: {why}"


def _apt_install(package: str) -> str:
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    made_policy = False
    if not _POLICY_RC.exists():
        _POLICY_RC.write_text("#!/bin/sh\nexit 101\n")
        _POLICY_RC.chmod(0o755)
        made_policy = True
    try:
        cmd = ["apt-get", "install", "-y", "-q", "--no-install-recommends", package]
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=INSTALL_TIMEOUT)
        if out.returncode != 0:  # a fresh machine has no package lists yet
            subprocess.run(["apt-get", "update", "-q"], env=env, capture_output=True, timeout=INSTALL_TIMEOUT)
            out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=INSTALL_TIMEOUT)
        said = (out.stderr or out.stdout).strip().splitlines()
        return (said[-1] if said else f"exit code {out.returncode}") if out.returncode else ""
    except (OSError, subprocess.TimeoutExpired) as exc:
        return str(exc)
    finally:
        if made_policy:
            _POLICY_RC.unlink(missing_ok=True)


def targets_of(stack: Stack) -> dict[str, str]:
    """The deploy config's job names -> this stack's metrics addresses."""
    out = {name: f"127.0.0.1:{port}" for name, port in stack.metrics_ports.items() if name != "gateway"}
    if "gateway" in stack.services:
        out["gateway"] = stack.addresses["gateway"]  # /metrics on its HTTP port
    return out


def config_for(targets: dict[str, str], interval: str = "1s") -> dict[str, Any]:
    """deploy/prometheus/prometheus.yml with its jobs pointed at `targets` (a job without a target is
    dropped), its rule files by absolute path, scraped and evaluated every `interval`."""
    config = yaml.safe_load(CONFIG.read_text())
    config["global"] = {"scrape_interval": interval, "evaluation_interval": interval}
    config["rule_files"] = [str(CONFIG.parent / f) for f in config.get("rule_files", [])]
    jobs = []
    for job in config["scrape_configs"]:
        if job["job_name"] in targets:
            job["static_configs"] = [{"targets": [targets[job["job_name"]]]}]
            jobs.append(job)
    config["scrape_configs"] = jobs
    return config


class Prometheus:
    """A Prometheus server on a loopback port, its data in `workdir`; stop() ends it."""

    def __init__(self, binary: str, workdir: Path, config: dict[str, Any]) -> None:
        self.binary = binary
        self.workdir = workdir
        self.config_path = workdir / "prometheus.yml"
        self.config_path.write_text(yaml.safe_dump(config))
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 30.0) -> None:
        log = (self.workdir / "prometheus.log").open("wb")
        argv = [self.binary, f"--config.file={self.config_path}", f"--storage.tsdb.path={self.workdir / 'data'}"]
        argv += [f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=warn"]
        self.proc = subprocess.Popen(argv, stdout=log, stderr=log)
        log.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"prometheus exited ({self.proc.returncode}): {self.log_tail()}")
            try:
                with urllib.request.urlopen(f"{self.url}/-/ready", timeout=1) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"prometheus not ready after {timeout:.0f} s: {self.log_tail()}")

    def log_tail(self) -> str:
        path = self.workdir / "prometheus.log"
        return "\n".join(path.read_text(errors="replace").splitlines()[-5:]) if path.exists() else ""

    def api(self, path: str, **params: Any) -> Any:
        """GET /api/v1/<path>: its `data`, or RuntimeError with Prometheus' error."""
        url = f"{self.url}/api/v1/{path}?{urllib.parse.urlencode(params)}"
        try:
            with urllib.request.urlopen(url, timeout=30) as r:
                body = json.load(r)
        except urllib.error.HTTPError as exc:  # a bad query: 400 with Prometheus' error in the body
            body = json.load(exc)
        if body.get("status") != "success":
            raise RuntimeError(f"{path} {params}: {body.get('errorType')}: {body.get('error')}")
        return body["data"]

    def query(self, expr: str, at: float | None = None) -> list[dict[str, Any]]:
        data = self.api("query", query=expr, **({"time": at} if at is not None else {}))
        return data["result"]

    def query_range(self, expr: str, start: float, end: float, step: float) -> list[dict[str, Any]]:
        return self.api("query_range", query=expr, start=start, end=end, step=step)["result"]

    def wait_scraped(self, jobs: set[str], timeout: float = 30.0) -> None:
        """Until every job's target has been scraped and is up."""
        deadline = time.monotonic() + timeout
        while True:
            up = {t["labels"]["job"] for t in self.api("targets")["activeTargets"] if t["health"] == "up"}
            if jobs <= up:
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"targets not up after {timeout:.0f} s: {sorted(jobs - up)}")
            time.sleep(0.2)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
