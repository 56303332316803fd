"""deploy/base (Kubernetes, kustomize): it renders, every object is valid for Kubernetes' own schemas
(offline, kubernetes-validate), every variable the settings read is set for every app container, and
the probes, disruption budgets and KEDA autoscaling point at what the project really provides."""

from __future__ import annotations

import ast
import copy
import shutil
import subprocess
from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from test_compose import check_entry_point

from inference import protocol

REPO = Path(__file__).resolve().parents[2]
BASE = REPO / "deploy" / "base"
SETTINGS = [REPO / "platform" / "tessera" / "settings" / name for name in ("base.py", "prod.py")]
APP_WORKLOADS = ("tessera-web", "tessera-engine", "tessera-embed", "tessera-worker", "tessera-beat", "tessera-migrate")
# KEDA's ScaledObject (keda.sh/v1alpha1) is a custom resource, so Kubernetes' schemas do not cover it;
# its fields are checked against KEDA's documentation (keda.sh/docs/latest/reference/scaledobject-spec,
# .../scalers/redis-streams) instead.
KEDA_SPEC_FIELDS = {
    "scaleTargetRef",
    "pollingInterval",
    "cooldownPeriod",
    "initialCooldownPeriod",
    "idleReplicaCount",
    "minReplicaCount",
    "maxReplicaCount",
    "fallback",
    "advanced",
    "triggers",
}
KEDA_REDIS_STREAMS_FIELDS = {
    "address",
    "addressFromEnv",
    "host",
    "hostFromEnv",
    "port",
    "portFromEnv",
    "username",
    "usernameFromEnv",
    "password",
    "passwordFromEnv",
    "stream",
    "consumerGroup",
    "pendingEntriesCount",
    "streamLength",
    "lagCount",
    "activationLagCount",
    "databaseIndex",
    "enableTLS",
    "unsafeSsl",
}


def render() -> list[dict]:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl (with kustomize) is not installed here")
    done = subprocess.run([kubectl, "kustomize", str(BASE)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return [doc for doc in yaml.safe_load_all(done.stdout) if doc]


@pytest.fixture(scope="module")
def objects() -> list[dict]:
    return render()


def by_kind(objects: list[dict], kind: str) -> dict[str, dict]:
    return {o["metadata"]["name"]: o for o in objects if o["kind"] == kind}


def pod_spec(workload: dict) -> dict:
    return workload["spec"]["template"]["spec"]


def workloads(objects: list[dict]) -> dict[str, dict]:
    return {**by_kind(objects, "Deployment"), **by_kind(objects, "Job")}


def variables_set(container: dict, objects: list[dict]) -> set[str]:
    """Names the container's environment gets: its env list and every ConfigMap/Secret in envFrom."""
    names = {e["name"] for e in container.get("env", [])}
    sources = {("configMapRef", n): o for n, o in by_kind(objects, "ConfigMap").items()}
    sources |= {("secretRef", n): o for n, o in by_kind(objects, "Secret").items()}
    for source in container.get("envFrom", []):
        [(ref, target)] = source.items()
        found = sources[(ref, target["name"])]
        names |= set(found.get("data", {})) | set(found.get("stringData", {}))
    return names


def variables_the_settings_read() -> set[str]:
    """Every os.environ.get("X") / os.environ["X"] / os.getenv("X") in the production settings."""
    names = set()
    for path in SETTINGS:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and ast.unparse(node.func) in ("os.environ.get", "os.getenv"):
                names.add(node.args[0].value)
            elif isinstance(node, ast.Subscript) and ast.unparse(node.value) == "os.environ":
                names.add(node.slice.value)
    return names


def test_the_base_renders_every_tier(objects):
    assert set(APP_WORKLOADS) == set(workloads(objects))
    assert {"tessera-config"} == set(by_kind(objects, "ConfigMap"))
    assert {"tessera-secrets"} == set(by_kind(objects, "Secret"))
    assert by_kind(objects, "Service")["tessera-web"]["spec"]["selector"] == pod_template_labels(
        workloads(objects)["tessera-web"]
    )


def pod_template_labels(workload: dict) -> dict:
    return {
        k: v for k, v in workload["spec"]["template"]["metadata"]["labels"].items() if k == "app.kubernetes.io/name"
    }


def test_every_kubernetes_object_validates_against_the_kubernetes_schemas(objects):
    version = kubernetes_validate.utils.latest_version()
    checked = [o for o in objects if o["apiVersion"] != "keda.sh/v1alpha1"]
    assert len(checked) == len(objects) - 1  # only the ScaledObject is left to the KEDA checks below
    for obj in checked:
        kubernetes_validate.validate(obj, version, strict=True)


def test_the_validator_is_strict_about_unknown_and_mistyped_fields(objects):
    version = kubernetes_validate.utils.latest_version()
    web = copy.deepcopy(workloads(objects)["tessera-web"])
    pod_spec(web)["containers"][0]["readinessprobe"] = {}  # a misspelt field
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(web, version, strict=True)
    job = copy.deepcopy(workloads(objects)["tessera-migrate"])
    job["spec"]["backoffLimit"] = "six"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(job, version, strict=True)


def test_every_variable_the_settings_read_is_set_for_every_app_container(objects):
    wanted = variables_the_settings_read()
    assert {"DATABASE_URL", "REDIS_URL", "SECRET_KEY", "ALLOWED_HOSTS", "MODEL"} <= wanted  # the parser works
    for name, workload in workloads(objects).items():
        spec = pod_spec(workload)
        for container in spec["containers"] + spec.get("initContainers", []):
            missing = wanted - variables_set(container, objects)
            assert not missing, f"{name}/{container['name']} does not set {sorted(missing)}"
            env = {e["name"]: e for e in container.get("env", [])}
            assert env["REDIS_URL"]["value"] == "redis://:$(REDIS_PASSWORD)@$(REDIS_HOST):$(REDIS_PORT)/0"


def test_secrets_come_from_the_secret_and_the_production_settings_are_used(objects):
    secret = by_kind(objects, "Secret")["tessera-secrets"]["stringData"]
    assert {"SECRET_KEY", "REDIS_PASSWORD", "DATABASE_URL"} == set(secret)
    assert secret["SECRET_KEY"] == ""  # no usable default: tessera.settings.prod refuses an empty one
    config = by_kind(objects, "ConfigMap")["tessera-config"]["data"]
    assert config["DJANGO_SETTINGS_MODULE"] == "tessera.settings.prod"
    assert not {"SECRET_KEY", "REDIS_PASSWORD", "DATABASE_URL"} & set(config)


def test_every_container_runs_a_real_entry_point_with_resource_requests(objects):
    for name, workload in workloads(objects).items():
        spec = pod_spec(workload)
        for container in spec["containers"] + spec.get("initContainers", []):
            command = container["command"]
            if command[:2] == ["sh", "-c"]:
                assert "python manage.py migrate --check" in command[2]  # the init containers' wait
            else:
                check_entry_point(command)
            requests = container["resources"]["requests"]
            assert requests["cpu"] and requests["memory"], f"{name}/{container['name']}"


def probe_command(probe: dict) -> list[str]:
    return probe["exec"]["command"]


def test_the_engine_is_ready_only_once_its_own_heartbeat_exists(objects):
    engine = pod_spec(workloads(objects)["tessera-engine"])["containers"][0]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert probe_command(engine[probe]) == ["python", "-m", "tessera.healthcheck", "engine"]
        check_entry_point(probe_command(engine[probe]))
    # the heartbeat the probe reads is this pod's: its worker id is the pod's name
    env = {e["name"]: e for e in engine["env"]}
    assert env["ENGINE_WORKER_ID"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    startup = engine["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 300  # time to load a model
    assert engine["resources"]["limits"]["nvidia.com/gpu"] == 1


def test_the_embedding_worker_is_make_runs_embed_worker_with_its_own_heartbeat(objects):
    from dataclasses import replace

    from inference.embedding_models import BUNDLED_NAME, EmbeddingModel
    from tessera.run import RunConfig, embedding_command

    embed = pod_spec(workloads(objects)["tessera-embed"])["containers"][0]
    env = {e["name"]: e for e in embed["env"]}
    # make run's own command line for its "embed" worker, on the folder and name this container sets.
    model = EmbeddingModel("$(EMBEDDING_MODEL)", "$(EMBEDDING_SERVED_MODEL_NAME)")
    [make_run_argv] = embedding_command(
        replace(RunConfig.from_env({"EMBEDDING_MODEL": "off"}), embedding=model)
    ).values()
    assert embed["command"] == ["python", "manage.py", *make_run_argv[2:]]
    assert env["EMBEDDING_SERVED_MODEL_NAME"]["value"] == BUNDLED_NAME
    assert env["ENGINE_WORKER_ID"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    assert env["ENGINE_ARGS"]["value"] == "{}"  # its own engine arguments, never the chat model's
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert probe_command(embed[probe]) == ["python", "-m", "tessera.healthcheck", "engine"]
    assert "nvidia.com/gpu" not in embed["resources"].get("limits", {})


def test_web_and_celery_have_probes_and_beat_runs_exactly_once(objects):
    deployments = by_kind(objects, "Deployment")
    web = pod_spec(deployments["tessera-web"])["containers"][0]
    check_entry_point(probe_command(web["readinessProbe"]))
    assert web["livenessProbe"]["tcpSocket"]["port"] == "http"
    worker = pod_spec(deployments["tessera-worker"])["containers"][0]
    assert "celery -A tessera inspect ping" in probe_command(worker["livenessProbe"])[2]
    beat = deployments["tessera-beat"]
    assert beat["spec"]["replicas"] == 1 and beat["spec"]["strategy"]["type"] == "Recreate"


def test_disruption_budgets_cover_web_and_engine_pods(objects):
    budgets = by_kind(objects, "PodDisruptionBudget")
    deployments = by_kind(objects, "Deployment")
    assert set(budgets) == {"tessera-web", "tessera-engine"}
    for name, budget in budgets.items():
        assert budget["spec"]["selector"]["matchLabels"] == pod_template_labels(deployments[name])
    assert budgets["tessera-web"]["spec"]["minAvailable"] < deployments["tessera-web"]["spec"]["replicas"]


def test_keda_scales_the_engine_on_the_request_streams_consumer_group_lag(objects):
    [scaled] = by_kind(objects, "ScaledObject").values()
    assert scaled["apiVersion"] == "keda.sh/v1alpha1"
    spec = scaled["spec"]
    assert set(spec) <= KEDA_SPEC_FIELDS
    assert spec["scaleTargetRef"] == {"name": "tessera-engine"}
    assert 1 <= spec["minReplicaCount"] <= spec["maxReplicaCount"]
    [trigger] = spec["triggers"]
    assert trigger["type"] == "redis-streams"
    metadata = trigger["metadata"]
    assert set(metadata) <= KEDA_REDIS_STREAMS_FIELDS
    assert all(isinstance(v, str) for v in metadata.values())  # KEDA's metadata is a map of strings
    config = by_kind(objects, "ConfigMap")["tessera-config"]["data"]
    assert metadata["stream"] == protocol.request_stream(config["SERVED_MODEL_NAME"])
    assert metadata["consumerGroup"] == protocol.CONSUMER_GROUP
    assert int(metadata["lagCount"]) > 0
    # *FromEnv names are read from the scale target's container
    engine = pod_spec(by_kind(objects, "Deployment")["tessera-engine"])["containers"][0]
    engine_env = variables_set(engine, objects)
    for key in ("hostFromEnv", "portFromEnv", "passwordFromEnv"):
        assert metadata[key] in engine_env
