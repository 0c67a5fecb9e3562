"""deploy/: the compose file is valid and says what one box needs (no Docker engine here to run it)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest
import yaml

from moe_lightning.service import names

ROOT = Path(__file__).resolve().parents[1]
HEALTH_NAMES = {  # the compose file's YAML must spell them out: check it against the protos
    "weight_store": names.WEIGHT_STORE,
    "cpu_attention": names.CPU_ATTENTION,
    "gpu_expert": names.GPU_EXPERT,
    "orchestrator": names.GENERATION,
}


def _core(compose: dict) -> dict:
    """The stack's own services: those outside a profile (monitoring's are tested on their own)."""
    return {name: svc for name, svc in compose["services"].items() if not svc.get("profiles")}


def test_compose_file() -> None:
    compose = yaml.safe_load((ROOT / "deploy" / "docker-compose.yml").read_text())
    services = _core(compose)
    assert set(services) == {*HEALTH_NAMES, "gateway"}
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    for name, svc in services.items():
        assert svc["command"][0] in scripts, f"{name}: {svc['command'][0]} is not a console script"
        test = svc["healthcheck"]["test"]
        if name == "gateway":  # HTTP: its /health answers 200 when the gRPC API is SERVING
            assert test[:2] == ["CMD", "python"] and "http://127.0.0.1:8000/health" in test[-1]
        else:
            assert test[:2] == ["CMD", "grpc-health-check"] and test[-1] == HEALTH_NAMES[name], name
        if name != "weight_store":
            assert svc["ipc"] == "service:weight_store", name  # one IPC namespace: /dev/shm is shared
        published = svc.get("ports", [])
        assert bool(published) == (name in ("orchestrator", "gateway")), f"{name} must not publish ports"
    assert services["weight_store"]["ipc"] == "shareable" and services["weight_store"]["shm_size"]
    deps = services["orchestrator"]["depends_on"]
    assert {d: v["condition"] for d, v in deps.items()} == {
        "gpu_expert": "service_healthy",
        "cpu_attention": "service_healthy",
    }
    for name in ("gpu_expert", "cpu_attention"):
        assert services[name]["depends_on"]["weight_store"]["condition"] == "service_healthy"
    # every flag the compose file passes exists on that service's parser
    from gateway.server import build_parser as http
    from orchestrator.server import build_parser as orch
    from services.cpu_attention.server import build_parser as attn
    from services.gpu_expert.server import build_parser as gpu
    from services.weight_store.server import build_parser as ws

    parsers = {"orchestrator": orch(), "cpu_attention": attn(), "gpu_expert": gpu(), "weight_store": ws()}
    parsers["gateway"] = http()
    assert services["gateway"]["depends_on"] == {"orchestrator": {"condition": "service_healthy"}}
    for name, svc in services.items():
        known = {o for a in parsers[name]._actions for o in a.option_strings}
        flags = [f for f in svc["command"][1:] if f.startswith("--")]
        assert set(flags) <= known, f"{name}: unknown flags {set(flags) - known}"


def test_compose_requires_a_token_and_keeps_internal_services_off_tcp() -> None:
    """The published API needs a bearer token (compose refuses to start without one: `:?`), passed by
    environment, not argv; the internal services listen on unix sockets only (on TCP any local user
    could call them)."""
    compose = yaml.safe_load((ROOT / "deploy" / "docker-compose.yml").read_text())
    services = _core(compose)
    for public in ("orchestrator", "gateway"):  # the gRPC API and the HTTP one: the same token
        token = services[public]["environment"]["MOE_LIGHTNING_AUTH_TOKEN"]
        assert token.startswith("${MOE_LIGHTNING_AUTH_TOKEN:?") and token.endswith("}"), token
        assert "--auth-token" not in services[public]["command"]  # ps would show it
    orch = services["orchestrator"]
    # the orchestrator's own mapping replaces the shared one: the run id must still be there
    assert orch["environment"]["MOE_LIGHTNING_RUN_ID"] == compose["x-service"]["environment"]["MOE_LIGHTNING_RUN_ID"]
    for name in ("weight_store", "cpu_attention", "gpu_expert"):
        cmd = services[name]["command"]
        assert cmd[cmd.index("--address") + 1].startswith("unix://"), name
        assert not services[name].get("ports"), name


def test_dockerfile_installs_the_health_probe() -> None:
    text = (ROOT / "deploy" / "Dockerfile").read_text()
    assert "grpc-health-check" in text and "pip install" in text
    assert (ROOT / "deploy" / "grpc_health_check.py").is_file()


def test_the_gpu_override_gives_gpu_expert_as_many_devices_as_ranks() -> None:
    compose = yaml.safe_load((ROOT / "deploy" / "docker-compose.yml").read_text())
    services = compose["services"]
    ws, gpu = services["weight_store"]["command"], services["gpu_expert"]["command"]
    assert ws[ws.index("--tensor-parallel") + 1] == gpu[gpu.index("--gpus") + 1] == "${GPUS:-1}"  # the same N
    override = yaml.safe_load((ROOT / "deploy" / "docker-compose.gpu.yml").read_text())
    assert set(override["services"]) == {"gpu_expert"}
    (devices,) = override["services"]["gpu_expert"]["deploy"]["resources"]["reservations"]["devices"]
    assert devices["count"] == "${GPUS:-1}" and devices["capabilities"] == ["gpu"]
    env = override["services"]["gpu_expert"]["environment"]  # replaces the base's mapping: its entries kept
    assert env["MOE_LIGHTNING_RUN_ID"] == services["gpu_expert"]["environment"]["MOE_LIGHTNING_RUN_ID"]


def test_an_empty_environment_default_counts_as_unset(monkeypatch: pytest.MonkeyPatch) -> None:
    from services.gpu_expert.server import build_parser

    monkeypatch.setenv("MOE_LIGHTNING_DEVICE_MEMORY", "")  # compose's ${DEVICE_MEMORY:-}
    assert build_parser().parse_args(["--weight-store", "unix:///x"]).device_memory is None
    monkeypatch.setenv("MOE_LIGHTNING_DEVICE_MEMORY", "2GiB")
    assert build_parser().parse_args(["--weight-store", "unix:///x"]).device_memory == 2 << 30


def test_the_monitoring_profile_runs_prometheus_and_grafana_on_loopback_with_deploys_files() -> None:
    """`docker compose --profile monitoring up`: Prometheus scrapes every service's metrics port as the
    compose file publishes it inside the network, Grafana provisions it and the dashboard, and both are
    published on 127.0.0.1 only (no Docker engine here: the file is checked as compose would read it)."""
    compose = yaml.safe_load((ROOT / "deploy" / "docker-compose.yml").read_text())
    services = compose["services"]
    monitoring = {name for name, svc in services.items() if svc.get("profiles")}
    assert monitoring == {"prometheus", "grafana"}
    for name in monitoring:
        svc = services[name]
        assert svc["profiles"] == ["monitoring"] and svc["image"].split(":")[1]  # a pinned version
        for port in svc["ports"]:
            assert port.startswith("127.0.0.1:"), f"{name} publishes {port} beyond loopback"
        for volume in svc["volumes"]:
            source = volume.split(":")[0]
            if source.startswith("./"):  # relative to the compose file, as compose resolves it
                assert (ROOT / "deploy" / source).exists(), f"{name} mounts {source}, which deploy/ lacks"
            else:
                assert source in compose["volumes"], f"{name}: volume {source} is not declared"
    # Prometheus: its config is the mounted one, and each job scrapes a service's --metrics-port
    prom = services["prometheus"]
    assert "--config.file=/etc/prometheus/prometheus.yml" in prom["command"]
    assert "./prometheus:/etc/prometheus:ro" in prom["volumes"]
    config = yaml.safe_load((ROOT / "deploy" / "prometheus" / "prometheus.yml").read_text())
    assert all((ROOT / "deploy" / "prometheus" / f).is_file() for f in config["rule_files"])
    jobs = {j["job_name"]: j["static_configs"][0]["targets"] for j in config["scrape_configs"]}
    assert set(jobs) == set(_core(compose))
    for name, (target,) in jobs.items():
        host, port = target.split(":")
        cmd = services[host]["command"]
        assert host == name
        if name == "gateway":  # /metrics on its HTTP port
            assert cmd[cmd.index("--address") + 1] == f"0.0.0.0:{port}"
        else:  # listening beyond the container's loopback, or Prometheus' container could not reach it
            assert cmd[cmd.index("--metrics-port") + 1] == port and cmd[cmd.index("--metrics-host") + 1] == "0.0.0.0"
    # Grafana: the provisioned datasource is that Prometheus, under the uid the dashboard names
    grafana = services["grafana"]
    assert grafana["depends_on"] == ["prometheus"]
    provisioning = ROOT / "deploy" / "grafana" / "provisioning"
    (source,) = yaml.safe_load((provisioning / "datasources" / "prometheus.yml").read_text())["datasources"]
    assert source["url"] == "http://prometheus:9090" and source["type"] == "prometheus"
    (provider,) = yaml.safe_load((provisioning / "dashboards" / "moe-lightning.yml").read_text())["providers"]
    assert f"./grafana/dashboards:{provider['options']['path']}:ro" in grafana["volumes"]
    home = grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert home == f"{provider['options']['path']}/moe-lightning.json"
    dash = json.loads((ROOT / "deploy" / "grafana" / "dashboards" / "moe-lightning.json").read_text())
    uids = {t["datasource"]["uid"] for p in dash["panels"] if p["type"] != "row" for t in p["targets"]}
    assert uids == {source["uid"]}


def test_the_dashboard_lays_out_every_panel_once() -> None:
    dash = json.loads((ROOT / "deploy" / "grafana" / "dashboards" / "moe-lightning.json").read_text())
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids)) and dash["uid"]
    taken: set[tuple[int, int]] = set()
    for p in dash["panels"]:
        g = p["gridPos"]
        assert g["x"] >= 0 and g["x"] + g["w"] <= 24, p["title"]
        cells = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not cells & taken, f"{p['title']} overlaps another panel"
        taken |= cells
        if p["type"] != "row":
            assert p["targets"] and all(t["expr"] and t["refId"] for t in p["targets"]), p["title"]
            assert p["description"], p["title"]  # what the panel means, shown on hover


def test_compose_validates_with_the_monitoring_profile_where_compose_runs() -> None:
    """Docker's own reading of the file, where a compose CLI exists (none does on the test machines)."""
    compose = shutil.which("docker-compose") or shutil.which("docker")
    if compose is None:
        pytest.skip("no docker compose CLI here; the structure is checked above")
    argv = [compose] if compose.endswith("docker-compose") else [compose, "compose"]
    env = {**os.environ, "MODEL_DIR": str(ROOT), "MOE_LIGHTNING_AUTH_TOKEN": "x"}
    file = str(ROOT / "deploy" / "docker-compose.yml")
    out = subprocess.run(
        [*argv, "-f", file, "--profile", "monitoring", "config", "--services"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    if out.returncode != 0 and ("unknown" in out.stderr or "is not a docker command" in out.stderr):
        pytest.skip(f"{' '.join(argv)} has no compose: {out.stderr.strip().splitlines()[0]}")
    assert out.returncode == 0, out.stderr
    assert {"prometheus", "grafana", *HEALTH_NAMES, "gateway"} == set(out.stdout.split())


def test_the_image_holds_every_package_the_project_installs() -> None:
    """`pip install .` in the image installs what was copied in: a package left out (the gateway
    once was) is missing from the image though every test here passes."""
    text = (ROOT / "deploy" / "Dockerfile").read_text()
    import tomllib

    include = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]["include"]
    for pattern in include:
        package = pattern.rstrip("*")
        assert f"COPY {package} ./{package}" in text, package
    assert 'pip install ".${EXTRAS}"' in text


def test_the_kuberay_manifests_run_our_job_on_gpu_pods() -> None:
    import shlex

    from moe_lightning.cli import build_parser

    cluster = yaml.safe_load((ROOT / "deploy" / "kuberay" / "raycluster.yaml").read_text())
    job = yaml.safe_load((ROOT / "deploy" / "kuberay" / "rayjob.yaml").read_text())
    assert cluster["kind"] == "RayCluster" and job["kind"] == "RayJob"
    assert job["spec"]["clusterSelector"]["ray.io/cluster"] == cluster["metadata"]["name"]
    assert cluster["spec"]["headGroupSpec"]["rayStartParams"]["num-cpus"] == "0"
    (workers,) = cluster["spec"]["workerGroupSpecs"]
    pod = workers["template"]["spec"]
    (container,) = pod["containers"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert mounts["dshm"] == "/dev/shm" and volumes["dshm"]["emptyDir"]["medium"] == "Memory"
    assert volumes["models"]["persistentVolumeClaim"]["claimName"]
    argv = shlex.split(job["spec"]["entrypoint"])
    assert argv[0] == "moe-lightning"
    args = build_parser().parse_args(argv[1:])  # our own CLI takes the entrypoint as written
    assert args.command == "run" and args.ray == "auto" and args.device == "cuda"
    assert str(args.model).startswith(mounts["models"]) and str(args.cache_dir).startswith(mounts["cache"])
