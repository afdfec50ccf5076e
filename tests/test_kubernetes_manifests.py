"""The Kubernetes manifests (deploy/kubernetes), rendered by kustomize (`kubectl kustomize`, offline) and
checked against the Kubernetes API's JSON schemas (kubernetes-validate): what they expose, where their
secrets come from, and that SGLang runs with the launcher's flags."""

from __future__ import annotations

import re
import shutil
import subprocess
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes_validate.utils import validate

from common.settings import Settings
from harness.processes import ROOT
from tests.test_compose import PARITY_CASES, assert_runs_the_launchers_command

MANIFESTS = ROOT / "deploy" / "kubernetes"
LAYOUTS = ("base", "sentinel")
# The oldest Kubernetes the manifests are written for: native sidecars (an init container with
# restartPolicy Always) are on by default from 1.29.
KUBERNETES_VERSION = "1.32"
API_PORT = 8000
SECRET_NAME = "openjev"


@cache
def rendered(layout: str) -> tuple[dict[str, Any], ...]:
    kubectl = shutil.which("kubectl")
    assert kubectl, "kubectl (with its built-in kustomize) renders the manifests; it is on every project machine"
    done = subprocess.run([kubectl, "kustomize", str(MANIFESTS / layout)], capture_output=True, text=True,
                          timeout=60, check=True)
    return tuple(doc for doc in yaml.safe_load_all(done.stdout) if doc)


def objects(layout: str, kind: str) -> list[dict[str, Any]]:
    return [doc for doc in rendered(layout) if doc["kind"] == kind]


def named(layout: str, kind: str, name: str) -> dict[str, Any]:
    [found] = [doc for doc in objects(layout, kind) if doc["metadata"]["name"] == name]
    return found


def pod_specs(layout: str) -> Iterator[tuple[str, dict[str, Any]]]:
    for doc in rendered(layout):
        if doc["kind"] in ("Deployment", "StatefulSet"):
            yield doc["metadata"]["name"], doc["spec"]["template"]["spec"]


def containers(pod: dict[str, Any]) -> list[dict[str, Any]]:
    return [*pod.get("initContainers", []), *pod["containers"]]


def container(layout: str, workload: str, name: str) -> dict[str, Any]:
    pod = dict(pod_specs(layout))[workload]
    [found] = [each for each in containers(pod) if each["name"] == name]
    return found


def config(layout: str) -> dict[str, str]:
    [found] = [doc for doc in objects(layout, "ConfigMap") if doc["metadata"]["name"].startswith("openjev-config-")]
    return found["data"]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_object_validates_against_the_kubernetes_schemas(layout: str) -> None:
    kinds = set()
    for doc in rendered(layout):
        kinds.add(doc["kind"])
        if doc["apiVersion"].startswith("keda.sh/"):
            continue  # a custom resource: no schema in the package (its fields: test_keda_scales_...)
        # strict: an unknown or misspelt field is an error, as `kubectl apply --validate=strict` makes it
        validate(doc, KUBERNETES_VERSION, strict=True)
    assert {"Deployment", "Service", "PodDisruptionBudget", "HorizontalPodAutoscaler", "ScaledObject",
            "NetworkPolicy", "ConfigMap"} <= kinds


def test_a_misspelt_field_fails_the_schema_check() -> None:
    api = yaml.safe_load(yaml.safe_dump(named("base", "Deployment", "openjev-api")))
    api["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = api["spec"]["template"]["spec"][
        "containers"][0].pop("readinessProbe")
    with pytest.raises(Exception, match="readinesProbe"):
        validate(api, KUBERNETES_VERSION, strict=True)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_only_the_api_is_exposed_outside_the_cluster(layout: str) -> None:
    exposed = {doc["metadata"]["name"] for doc in objects(layout, "Service")
               if doc["spec"].get("type", "ClusterIP") != "ClusterIP"}
    assert exposed == {"openjev-api"}
    api_service = named(layout, "Service", "openjev-api")
    assert [port["targetPort"] for port in api_service["spec"]["ports"]] == ["http"]
    assert api_service["spec"]["selector"]["app.kubernetes.io/component"] == "api"
    assert not objects(layout, "Ingress")
    for name, pod in pod_specs(layout):
        assert not pod.get("hostNetwork") and not pod.get("hostPID") and not pod.get("hostIPC"), name
        for each in containers(pod):
            assert all("hostPort" not in port for port in each.get("ports", [])), (name, each["name"])


@pytest.mark.parametrize("layout", LAYOUTS)
def test_sglang_listens_on_the_pods_loopback_only_and_has_no_service(layout: str) -> None:
    sglang = container(layout, "openjev-gpu", "sglang")
    script = sglang["command"][2]
    assert "--host 127.0.0.1 --port 30000" in script
    assert "ports" not in sglang
    assert all(port.get("port") != 30000 for doc in objects(layout, "Service") for port in doc["spec"]["ports"])
    worker = container(layout, "openjev-gpu", "worker")
    assert env_values(worker)["OPENJEV_ENGINE_URL"] == "http://127.0.0.1:30000"
    assert "ports" not in worker


@pytest.mark.parametrize("layout", LAYOUTS)
def test_redis_is_reachable_only_inside_the_cluster_from_openjev_pods(layout: str) -> None:
    for doc in objects(layout, "Service"):
        ports = {port["port"] for port in doc["spec"]["ports"]}
        if ports & {6379, 26379}:
            assert doc["spec"].get("clusterIP") == "None" and doc["spec"].get("type", "ClusterIP") == "ClusterIP"
    policies = {doc["metadata"]["name"]: doc["spec"] for doc in objects(layout, "NetworkPolicy")}
    deny = policies["openjev-default-deny"]
    assert deny["podSelector"]["matchLabels"] == {"app.kubernetes.io/name": "openjev"}
    assert deny["policyTypes"] == ["Ingress"] and "ingress" not in deny
    allowed = {name: spec for name, spec in policies.items() if spec.get("ingress")}
    assert [rule.get("from") for rule in allowed["openjev-api"]["ingress"]] == [None]  # clients: anyone
    assert allowed["openjev-api"]["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "api"
    if layout == "sentinel":
        [rule] = allowed["openjev-redis"]["ingress"]
        assert rule["from"] == [{"podSelector": {"matchLabels": {"app.kubernetes.io/name": "openjev"}}}]
        assert {port["port"] for port in rule["ports"]} == {6379, 26379}
    assert set(allowed) == {"openjev-api", *(["openjev-redis"] if layout == "sentinel" else [])}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_api_is_ready_on_health_and_alive_on_health_live(layout: str) -> None:
    api = container(layout, "openjev-api", "api")
    assert api["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert api["livenessProbe"]["httpGet"] == {"path": "/health/live", "port": "http"}
    assert api["ports"] == [{"name": "http", "containerPort": API_PORT}]
    assert api["args"] == ["api", "--host", "0.0.0.0", "--port", str(API_PORT)]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_api_has_a_disruption_budget_and_a_cpu_autoscaler(layout: str) -> None:
    budget = named(layout, "PodDisruptionBudget", "openjev-api")["spec"]
    api = named(layout, "Deployment", "openjev-api")
    assert budget["selector"]["matchLabels"] == api["spec"]["selector"]["matchLabels"]
    assert budget["minAvailable"] == 1
    hpa = named(layout, "HorizontalPodAutoscaler", "openjev-api")["spec"]
    assert hpa["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "openjev-api"}
    assert hpa["minReplicas"] >= 2 > budget["minAvailable"]  # a drain can always take one API pod


def env_values(each: dict[str, Any]) -> dict[str, str]:
    return {item["name"]: item["value"] for item in each.get("env", []) if "value" in item}


SECRET_NAMES = re.compile(r"PASSWORD|API_KEY|_TOKEN$|SECRET", re.IGNORECASE)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_secrets_come_from_the_secret_never_from_literals(layout: str) -> None:
    assert not objects(layout, "Secret")  # the operator creates it (README); the manifests never carry one
    seen = set()
    for name, pod in pod_specs(layout):
        for each in containers(pod):
            for item in each.get("env", []):
                if SECRET_NAMES.search(item["name"]):
                    assert "value" not in item, (name, each["name"], item["name"])
                    assert item["valueFrom"]["secretKeyRef"]["name"] == SECRET_NAME
                    seen.add(item["valueFrom"]["secretKeyRef"]["key"])
            refs = [source.get("secretRef") for source in each.get("envFrom", [])]
            assert refs == [None] * len(refs)  # env comes in by key, so a Secret's extra keys stay out
    assert {"redis-password", "api-key", "hf-token", "backend-api-key"} <= seen
    for doc in objects(layout, "ConfigMap"):
        for key, value in doc["data"].items():
            assert not SECRET_NAMES.search(key), key
            assert not re.search(r"redis://[^/@]*:[^/@]*@", value), key  # no password in a URL


@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_configuration_is_valid_settings(layout: str) -> None:
    env = {key.removeprefix("OPENJEV_").lower(): value for key, value in config(layout).items()
           if key.startswith("OPENJEV_")}
    settings = Settings(_env_file=None, redis_password="pw", **env)  # type: ignore[call-arg]
    defaults = Settings(_env_file=None)  # type: ignore[call-arg]
    assert settings.model == defaults.model and settings.served_model_name == defaults.served_model_name
    assert settings.max_input_tokens == defaults.max_input_tokens
    if layout == "sentinel":
        statefulset = named(layout, "StatefulSet", "openjev-redis")
        service = statefulset["spec"]["serviceName"]
        pods = [f"openjev-redis-{i}.{service}" for i in range(statefulset["spec"]["replicas"])]
        assert [f"{host}:{port}" for host, port in settings.redis_sentinels] == [f"{pod}:26379" for pod in pods]
        assert settings.redis_sentinel_master == "openjev"
    else:
        assert settings.redis_sentinels == []


@pytest.mark.parametrize("overrides", PARITY_CASES.values(), ids=PARITY_CASES.keys())
def test_sglang_command_is_the_launchers(overrides: dict[str, str], tmp_path: Path) -> None:
    sglang = container("base", "openjev-gpu", "sglang")
    assert sglang["command"][:2] == ["/bin/sh", "-c"]
    env = {**config("base"), **env_values(sglang), **overrides}
    assert_runs_the_launchers_command(sglang["command"][2], env, env.get("SGLANG_EXTRA_ARGS", ""), "127.0.0.1",
                                      tmp_path)


def test_each_gpu_pod_holds_one_gpu_its_sglang_and_its_worker() -> None:
    pod = dict(pod_specs("base"))["openjev-gpu"]
    [sglang] = pod["initContainers"]
    assert sglang["restartPolicy"] == "Always"  # a sidecar: the worker starts once its startup probe passes
    assert "/health" in " ".join(sglang["startupProbe"]["exec"]["command"])
    assert sglang["resources"]["limits"]["nvidia.com/gpu"] == 1
    [worker] = pod["containers"]
    assert worker["args"] == ["worker"]
    [worker_id] = [item for item in worker["env"] if item["name"] == "OPENJEV_WORKER_ID"]
    assert worker_id["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.name"}}  # unique per pod
    assert all("nvidia.com/gpu" not in (each.get("resources", {}).get("limits") or {})
               for each in containers(dict(pod_specs("base"))["openjev-api"]))


def test_keda_scales_the_gpu_pods_on_the_backlog_from_prometheus() -> None:
    [scaled] = objects("base", "ScaledObject")
    assert scaled["apiVersion"] == "keda.sh/v1alpha1"
    spec = scaled["spec"]
    target = named("base", "Deployment", spec["scaleTargetRef"]["name"])
    assert target["metadata"]["name"] == "openjev-gpu"
    assert 1 <= spec["minReplicaCount"] <= spec["maxReplicaCount"]
    [trigger] = spec["triggers"]
    assert trigger["type"] == "prometheus"
    metadata = trigger["metadata"]
    assert set(metadata) >= {"serverAddress", "query", "threshold"}
    assert "openjev_queue_waiting_jobs" in metadata["query"]
    assert float(metadata["threshold"]) > 0
    assert all(isinstance(value, str) for value in metadata.values())  # KEDA's trigger metadata is string-valued
    # the HPA that KEDA creates for the GPU pods is the only one on them
    assert all(hpa["spec"]["scaleTargetRef"]["name"] != "openjev-gpu"
               for hpa in objects("base", "HorizontalPodAutoscaler"))


def test_the_sentinel_redis_keeps_the_readme_rules_on_persistent_volumes() -> None:
    statefulset = named("sentinel", "StatefulSet", "openjev-redis")
    spec = statefulset["spec"]
    assert spec["replicas"] == 3  # one master, two replicas, three Sentinels (two must agree)
    [claim] = spec["volumeClaimTemplates"]
    redis = container("sentinel", "openjev-redis", "redis")
    assert {"name": claim["metadata"]["name"], "mountPath": "/data"} in redis["volumeMounts"]
    [scripts] = [doc for doc in objects("sentinel", "ConfigMap")
                 if doc["metadata"]["name"].startswith("openjev-redis-scripts-")]
    start = scripts["data"]["start-redis.sh"]
    for rule in ("appendonly yes", "appendfsync everysec", "maxmemory 3gb", "maxmemory-policy noeviction",
                 "requirepass $REDIS_PASSWORD", "masterauth $REDIS_PASSWORD", "exec redis-server - <<CONF"):
        assert rule in start, rule
    sentinel = scripts["data"]["start-sentinel.sh"]
    for rule in ("requirepass $REDIS_PASSWORD", "sentinel sentinel-pass $REDIS_PASSWORD",  # to each other
                 "sentinel auth-pass openjev $REDIS_PASSWORD"):
        assert rule in sentinel, rule
    assert "sentinel monitor openjev $master 6379 2" in sentinel
    # An election that does not finish is tried again after twice this: 20 s, not minutes.
    assert "sentinel failover-timeout openjev 10000" in sentinel
    for each in containers(spec["template"]["spec"]):
        assert not any("$REDIS_PASSWORD" in arg for arg in each["command"])  # never on a command line
    for name, text in scripts["data"].items():
        checked = subprocess.run(["/bin/sh", "-n"], input=text, capture_output=True, text=True, timeout=10)
        assert checked.returncode == 0, (name, checked.stderr)


def run_pod_script(script: str, scripts: dict[str, str], tmp_path: Path, pod: str, sentinels_name: str | None) -> str:
    """Run one of the Redis pod's start scripts with stand-ins for `hostname`, `redis-cli` (the Sentinels'
    answer) and `redis-server` (prints the configuration it was given); returns that configuration."""
    bin_dir, mounted = tmp_path / "bin", tmp_path / "scripts"
    for folder in (bin_dir, mounted, tmp_path / "sentinel"):
        folder.mkdir(exist_ok=True)
    for name, text in scripts.items():
        text = text.replace("/scripts/", f"{mounted}/").replace("/sentinel/", f"{tmp_path}/sentinel/")
        (mounted / name).write_text(text)
    fakes = {"hostname": f'echo "{pod}"',
             "redis-cli": f'printf "%s\\n%s\\n" "{sentinels_name}" 6379' if sentinels_name else "exit 1",
             "redis-server": 'if [ "$1" = - ]; then cat; else cat "$1"; fi'}
    for name, body in fakes.items():
        (bin_dir / name).write_text(f"#!/bin/sh\n{body}\n")
        (bin_dir / name).chmod(0o755)
    done = subprocess.run(["/bin/sh", str(mounted / script)], capture_output=True, text=True, timeout=30, check=True,
                          env={"PATH": f"{bin_dir}:/usr/bin:/bin", "REDIS_PASSWORD": "pw"})
    return done.stdout


@pytest.mark.parametrize(("pod", "sentinels_name", "master"), [
    ("openjev-redis-0", None, None),  # first start: pod 0 is the master
    ("openjev-redis-1", None, "openjev-redis-0.openjev-redis"),
    ("openjev-redis-0", "openjev-redis-2.openjev-redis", "openjev-redis-2.openjev-redis"),  # after a failover
    ("openjev-redis-2", "openjev-redis-2.openjev-redis", None),
], ids=["first start, pod 0", "first start, pod 1", "pod 0 after a failover", "the promoted pod restarts"])
def test_a_redis_pod_starts_as_a_replica_of_the_master_the_sentinels_name(
        pod: str, sentinels_name: str | None, master: str | None, tmp_path: Path) -> None:
    [scripts] = [doc["data"] for doc in objects("sentinel", "ConfigMap")
                 if doc["metadata"]["name"].startswith("openjev-redis-scripts-")]
    redis_config = run_pod_script("start-redis.sh", scripts, tmp_path, pod, sentinels_name).splitlines()
    assert "requirepass pw" in redis_config and "appendonly yes" in redis_config
    assert [line for line in redis_config if line.startswith("replicaof")] == (
        [f"replicaof {master} 6379"] if master else [])
    sentinel_config = run_pod_script("start-sentinel.sh", scripts, tmp_path, pod, sentinels_name).splitlines()
    monitored = master or f"{pod}.openjev-redis"
    assert f"sentinel monitor openjev {monitored} 6379 2" in sentinel_config
    assert f"sentinel announce-ip {pod}.openjev-redis" in sentinel_config
    assert oct((tmp_path / "sentinel" / "sentinel.conf").stat().st_mode & 0o777) == "0o600"  # it holds the password
