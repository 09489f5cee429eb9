"""deploy/kubernetes: the manifests ``kubectl apply -k`` is handed, checked offline.

No cluster runs in CI, so every Kubernetes object is validated against that release's own
JSON schema, strict (an unknown field fails), from the schemas the ``kubernetes-validate``
package ships; the KEDA ScaledObject against tests/data's schema, written from KEDA's
documentation (no registry package ships the CRD's schema as data). Then what the guide
promises: probes on the health endpoints, the shutdown grace inside the pod's termination
grace, the URLs read from mounted secret files, settings a node accepts.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable, Iterator
from dataclasses import fields
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from wm import Settings
from wm.config import FILE_SUFFIX, FROM_FILE

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy" / "kubernetes"
KEDA_SCHEMA = json.loads(
    (ROOT / "tests" / "data" / "keda-scaledobject-v1alpha1.schema.json").read_text()
)
#: The oldest Kubernetes release the manifests are for (appArmorProfile came with 1.30).
KUBERNETES_VERSION = "1.30"
#: Seconds the pod keeps after the node's own shutdown grace, for Celery to close.
SHUTDOWN_MARGIN_S = 5
SECRETS_DIR = "/run/secrets/"


def _manifests() -> list[dict[str, Any]]:
    kustomization = yaml.safe_load((DEPLOY / "kustomization.yaml").read_text())
    objects = []
    for name in kustomization["resources"]:
        objects += [o for o in yaml.safe_load_all((DEPLOY / name).read_text()) if o]
    return objects


def validate(manifest: dict[str, Any]) -> None:
    """Raise ``jsonschema.ValidationError`` unless ``manifest`` fits its kind's schema."""
    if manifest["apiVersion"].startswith("keda.sh/"):
        jsonschema.validate(manifest, KEDA_SCHEMA)
    else:
        kubernetes_validate.validate(manifest, KUBERNETES_VERSION, strict=True)


def _named(kind: str, name: str) -> dict[str, Any]:
    (found,) = [m for m in _manifests() if (m["kind"], m["metadata"]["name"]) == (kind, name)]
    return found


def _containers() -> Iterator[tuple[dict[str, Any], dict[str, Any]]]:
    """Every (pod spec, container) of the workloads."""
    for manifest in _manifests():
        if manifest["kind"] in ("Deployment", "Job"):
            pod = manifest["spec"]["template"]["spec"]
            for container in pod["containers"]:
                yield pod, container


def _env(container: dict[str, Any]) -> dict[str, str]:
    """The container's environment: its config maps' data, then its own ``env``."""
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        env.update(_named("ConfigMap", source["configMapRef"]["name"])["data"])
    env.update({e["name"]: e["value"] for e in container.get("env", [])})
    return env


def test_the_kustomization_lists_every_manifest() -> None:
    listed = set(yaml.safe_load((DEPLOY / "kustomization.yaml").read_text())["resources"])
    assert listed == {p.name for p in DEPLOY.glob("*.yaml")} - {"kustomization.yaml"}


@pytest.mark.parametrize(
    "manifest", _manifests(), ids=lambda m: f"{m['kind']}/{m['metadata']['name']}"
)
def test_every_manifest_fits_its_schema(manifest: dict[str, Any]) -> None:
    validate(manifest)


def _pod(m: dict[str, Any]) -> dict[str, Any]:
    spec: dict[str, Any] = m["spec"]["template"]["spec"]
    return spec


BREAKAGES: dict[str, tuple[tuple[str, str], Callable[[dict[str, Any]], None]]] = {
    "misspelt pod field": (
        ("Deployment", "wm-node"),
        lambda m: _pod(m).update(terminationGracePeriodSecond=35),
    ),
    "port as text": (
        ("Deployment", "wm-node"),
        lambda m: _pod(m)["containers"][0]["ports"][0].update(containerPort="8001"),
    ),
    "probe without a handler field": (
        ("Deployment", "wm-api"),
        lambda m: _pod(m)["containers"][0]["livenessProbe"]["httpGet"].pop("port"),
    ),
    "KEDA threshold as a number": (
        ("ScaledObject", "wm-node"),
        lambda m: m["spec"]["triggers"][0]["metadata"].update(threshold=100),
    ),
    "KEDA misspelt field": (
        ("ScaledObject", "wm-node"),
        lambda m: m["spec"].update(maxReplicas=10),
    ),
    "KEDA prometheus trigger without a query": (
        ("ScaledObject", "wm-node"),
        lambda m: m["spec"]["triggers"][0]["metadata"].pop("query"),
    ),
}


@pytest.mark.parametrize("breakage", sorted(BREAKAGES))
def test_a_broken_manifest_fails(breakage: str) -> None:
    (kind, name), breaks = BREAKAGES[breakage]
    manifest = copy.deepcopy(_named(kind, name))
    breaks(manifest)
    with pytest.raises(jsonschema.ValidationError):
        validate(manifest)


def test_the_node_probes_its_health_endpoints() -> None:
    pod = _pod(_named("Deployment", "wm-node"))
    (node,) = pod["containers"]
    env = _env(node)
    (port,) = node["ports"]
    assert port["containerPort"] == int(env["WM_HEALTH_PORT"])
    assert env["WM_HEALTH_BIND"] == "0.0.0.0"  # the kubelet probes from outside the pod
    assert node["livenessProbe"]["httpGet"] == {"path": "/health/live", "port": port["name"]}
    assert node["readinessProbe"]["httpGet"] == {"path": "/health/ready", "port": port["name"]}


def test_the_termination_grace_covers_the_shutdown_grace() -> None:
    """The kubelet's SIGKILL comes after the node has ended what outlived its grace."""
    pod = _pod(_named("Deployment", "wm-node"))
    grace_s = float(_env(pod["containers"][0])["WM_SHUTDOWN_GRACE_S"])
    assert grace_s == Settings().shutdown_grace_s  # the manifest says the default out loud
    assert grace_s > 0  # 0 would wait for ever: the kubelet would kill it mid-delivery
    assert pod["terminationGracePeriodSeconds"] >= grace_s + SHUTDOWN_MARGIN_S
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    assert compose["services"]["worker"]["stop_grace_period"] == (
        f"{pod['terminationGracePeriodSeconds']}s"
    )


#: The settings a pod reads from its mounted secrets (``WM_API_TOKEN`` is the ``wm``
#: command's, which no pod runs).
URLS = ("WM_DATABASE_URL", "WM_BROKER_URL", "WM_REDIS_URL")


def test_the_urls_come_from_mounted_secret_files() -> None:
    for pod, container in _containers():
        env = _env(container)
        secret_mounts = {
            m["mountPath"]
            for m in container["volumeMounts"]
            for v in pod["volumes"]
            if v["name"] == m["name"] and "secret" in v
        }
        for name in URLS:
            assert name not in env, f"{container['name']}: {name} in the environment"
            path = env[name + FILE_SUFFIX]
            assert path.startswith(SECRETS_DIR)
            assert str(Path(path).parent) in secret_mounts, f"{container['name']}: {path}"


def test_a_node_accepts_the_manifests_settings(tmp_path: Path) -> None:
    """The node's environment, its secret files laid in a directory here, parses."""
    (node,) = _pod(_named("Deployment", "wm-node"))["containers"]
    env = _env(node)
    urls = {
        "WM_DATABASE_URL": "postgresql+psycopg://wm:secret@postgres:5432/wm",
        "WM_BROKER_URL": "redis://:secret@redis:6379/0",
        "WM_REDIS_URL": "redis://:secret@redis:6379/1",
    }
    for name, url in urls.items():
        path = tmp_path / Path(env[name + FILE_SUFFIX]).name
        path.write_text(url + "\n")
        env[name + FILE_SUFFIX] = str(path)
    settings = Settings.from_env(env)
    assert (settings.database_url, settings.broker_url, settings.redis_url) == tuple(urls.values())
    assert settings.health_port == 8001


def test_every_setting_in_the_manifests_is_known() -> None:
    known = {f.metadata["env"] for f in fields(Settings)} | {n + FILE_SUFFIX for n in FROM_FILE}
    for _pod_spec, container in _containers():
        unknown = {n for n in _env(container) if n.startswith("WM_")} - known
        assert not unknown, f"{container['name']}: {unknown}"


def test_keda_scales_the_node_deployment_on_the_queue_depth() -> None:
    scaled = _named("ScaledObject", "wm-node")
    assert (
        scaled["spec"]["scaleTargetRef"]["name"]
        == _named("Deployment", "wm-node")["metadata"]["name"]
    )
    (trigger,) = scaled["spec"]["triggers"]
    assert "wm_queue_depth" in trigger["metadata"]["query"]
    pod = _named("Deployment", "wm-node")["spec"]["template"]["metadata"]["annotations"]
    assert pod["prometheus.io/scrape"] == "true"  # Prometheus has the metric KEDA reads
