"""deploy/: every kustomization builds (`kubectl kustomize`), every object validates against its
published schema, the pieces agree with each other and with tritonlm (its flags, ports, health
endpoints and metric names), and the containers' entrypoint converts a model as it does in a pod."""
import functools
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import types
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from tritonlm.distributed import worker
from tritonlm.distributed.ranks import EXTERNAL_WORKERS_VARIABLE
from tritonlm.engine.stats import StepStats
from tritonlm.serve import build_command
from tritonlm.triton.contract import EXPLICIT_CONTROL_VARIABLE
from tritonlm_frontend.cli import build_parser as frontend_parser

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
ENTRYPOINT = DEPLOY / "base" / "entrypoint.sh"
BUILDS = ("base", "overlays/cpu", "overlays/gpu", "overlays/multinode-gpu",
          "overlays/gpu + components/object-storage")
# Kubernetes releases whose schemas the core objects must meet: that of the kubectl here and the
# newest that kubernetes-validate ships.
KUBERNETES_VERSIONS = ("1.32", "1.37")
MODEL = "llm"  # tritonlm-convert's default name, which the entrypoint converts into
# Custom resources validated by the npm packages of kubernetes-models (schemas generated from the
# projects' own API types), installed by tools/setup.sh into the venv.
NODE_PREFIX = Path(sys.prefix) / "node"
PUBLISHED_MODELS = {
    ("keda.sh/v1alpha1", "ScaledObject"): "@kubernetes-models/keda/keda.sh/v1alpha1/ScaledObject",
    ("monitoring.coreos.com/v1", "ServiceMonitor"):
        "@kubernetes-models/prometheus-operator/monitoring.coreos.com/v1/ServiceMonitor",
    ("gateway.networking.k8s.io/v1", "HTTPRoute"):
        "@kubernetes-models/gateway-api/gateway.networking.k8s.io/v1/HTTPRoute",
}
# No registry package publishes these two: the LeaderWorkerSet's pod templates are validated as
# core PodTemplates, both are checked field by field below.
UNPUBLISHED = {("leaderworkerset.x-k8s.io/v1", "LeaderWorkerSet"),
               ("inference.networking.k8s.io/v1", "InferencePool")}
VALIDATE_WITH_NODE = """
import { readFileSync } from "node:fs";
const [models, objects] = JSON.parse(readFileSync(0, "utf8"));
const errors = [];
for (const object of objects) {
  const model = (await import(models[`${object.apiVersion} ${object.kind}`]))[object.kind];
  try { new model(object).validate(); }
  catch (error) { errors.push(`${object.kind} ${object.metadata.name}: ${error.message}`); }
}
console.log(JSON.stringify(errors));
"""


@functools.cache
def objects(build: str) -> tuple[dict, ...]:
    """What `kubectl kustomize` makes of a kustomization under deploy/, or of an overlay with one
    more component ("OVERLAY + COMPONENT")."""
    if shutil.which("kubectl") is None:
        pytest.skip("kubectl is not installed: the kustomize builds cannot be made")
    overlay, _, component = build.partition(" + ")
    with tempfile.TemporaryDirectory() as scratch:
        root = DEPLOY / overlay
        if component:
            # kustomize takes bases and components by relative path only
            relative = functools.partial(os.path.relpath, start=scratch)
            Path(scratch, "kustomization.yaml").write_text(yaml.safe_dump({
                "resources": [relative(root)], "components": [relative(DEPLOY / component)]}))
            root = scratch
        result = subprocess.run(["kubectl", "kustomize", str(root)], capture_output=True,
                                text=True)
    assert result.returncode == 0, result.stderr
    return tuple(yaml.safe_load_all(result.stdout))


def find(build: str, kind: str, name: str) -> dict:
    (found,) = [o for o in objects(build) if o["kind"] == kind and o["metadata"]["name"] == name]
    return found


def container(pod: dict, name: str) -> dict:
    (found,) = [c for c in pod["spec"]["containers"] if c["name"] == name]
    return found


def env(container_spec: dict) -> dict:
    return {e["name"]: e.get("value") for e in container_spec.get("env", [])}


def serving_pod(build: str) -> dict:
    """The pod template that serves: the Deployment's, or the LeaderWorkerSet's leader's."""
    pods = [o["spec"]["template"] for o in objects(build)
            if o["kind"] == "Deployment" and o["metadata"]["name"] == "tritonlm"]
    pods += [o["spec"]["leaderWorkerTemplate"]["leaderTemplate"] for o in objects(build)
             if o["kind"] == "LeaderWorkerSet"]
    (pod,) = pods
    return pod


def port_number(container_spec: dict, port) -> int:
    """A container port given by number or by name."""
    if isinstance(port, int):
        return port
    (number,) = [p["containerPort"] for p in container_spec["ports"] if p["name"] == port]
    return number


def selects(selector: dict, labels: dict) -> bool:
    return selector.items() <= labels.items()


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
@pytest.mark.parametrize("build", BUILDS)
def test_core_objects_validate(build, version):
    for obj in objects(build):
        if (obj["apiVersion"], obj["kind"]) in PUBLISHED_MODELS.keys() | UNPUBLISHED:
            continue
        kubernetes_validate.validate(obj, version, strict=True)


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_leaderworkerset_pod_templates_validate(version):
    lws = find("overlays/multinode-gpu", "LeaderWorkerSet", "tritonlm")
    for role in ("leaderTemplate", "workerTemplate"):
        template = lws["spec"]["leaderWorkerTemplate"][role]
        kubernetes_validate.validate({"apiVersion": "v1", "kind": "PodTemplate",
                                      "metadata": {"name": role.lower()}, "template": template},
                                     version, strict=True)


def test_custom_resources_validate_against_their_published_schemas():
    if shutil.which("node") is None or not (NODE_PREFIX / "node_modules").is_dir():
        pytest.skip(f"the CRD schemas' npm packages are not in {NODE_PREFIX}: run tools/setup.sh")
    custom = [o for build in BUILDS for o in objects(build)
              if (o["apiVersion"], o["kind"]) in PUBLISHED_MODELS]
    assert {o["kind"] for o in custom} == {kind for _, kind in PUBLISHED_MODELS}
    models = {f"{api} {kind}": module for (api, kind), module in PUBLISHED_MODELS.items()}
    result = subprocess.run(["node", "--input-type=module", "-e", VALIDATE_WITH_NODE],
                            input=json.dumps([models, custom]), capture_output=True, text=True,
                            cwd=NODE_PREFIX, timeout=60)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == []


@pytest.mark.parametrize("build", BUILDS)
def test_tritonserver_runs_as_tritonlm_serve_runs_it(build, tmp_path):
    """Explicit model control (with tritonlm told so) lets a model whose engine died unload
    itself, i.e. report not ready."""
    serve_argv, serve_env = build_command(tmp_path)
    behaviour = [a for a in serve_argv[1:] if a.split("=")[0] in (
        "--model-control-mode", "--load-model", "--strict-readiness", "--exit-on-error",
        "--disable-auto-complete-config")]
    server = container(serving_pod(build), "tritonserver")
    assert server["command"] == ["sh", "/etc/tritonlm/entrypoint.sh"]
    assert server["args"][0] == "tritonserver"
    assert set(behaviour) <= set(server["args"])
    assert "--model-repository=$(MODEL_REPOSITORY)" in server["args"]
    assert env(server)[EXPLICIT_CONTROL_VARIABLE] == serve_env[EXPLICIT_CONTROL_VARIABLE]
    assert ("--allow-gpu-metrics=false" in server["args"]) == (build == "overlays/cpu")


@pytest.mark.parametrize("build", BUILDS)
def test_probes_ask_triton_whether_the_model_is_ready(build):
    server = container(serving_pod(build), "tritonserver")
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        get = server[probe]["httpGet"]
        assert get["path"] == f"/v2/models/{MODEL}/ready"
        assert port_number(server, get["port"]) == 8000


@pytest.mark.parametrize("build", BUILDS)
def test_front_end_beside_tritonserver(build):
    pod = serving_pod(build)
    frontend = container(pod, "frontend")
    assert frontend["command"] == ["tritonlm-frontend"]
    args = frontend_parser().parse_args(frontend["args"])
    assert args.triton_url == ["localhost:8001"] and args.port == 8080
    assert port_number(frontend, "http") == 8080
    assert frontend["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    # it reads the repository tritonserver's entrypoint converted into
    mounts = {c["name"]: {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
              for c in pod["spec"]["containers"]}
    assert args.model_repository == Path(mounts["frontend"]["model-repository"])
    assert mounts["frontend"]["model-repository"] == mounts["tritonserver"]["model-repository"]


@pytest.mark.parametrize("build", BUILDS)
def test_service_reaches_the_serving_pods(build):
    pod = serving_pod(build)
    service = find(build, "Service", "tritonlm")
    assert selects(service["spec"]["selector"], pod["metadata"]["labels"])
    pod_ports = {p["name"]: p["containerPort"] for c in pod["spec"]["containers"]
                 for p in c["ports"]}
    assert {p["port"]: pod_ports[p["targetPort"]] for p in service["spec"]["ports"]} == {
        8080: 8080, 8000: 8000, 8001: 8001, 8002: 8002}
    assert pod["metadata"]["annotations"]["prometheus.io/port"] == str(pod_ports["metrics"])


@pytest.mark.parametrize("build", BUILDS[1:])
def test_service_monitor_scrapes_the_service(build):
    service = find(build, "Service", "tritonlm")
    monitor = find(build, "ServiceMonitor", "tritonlm")["spec"]
    assert selects(monitor["selector"]["matchLabels"], service["metadata"]["labels"])
    ports = {e["port"] for e in monitor["endpoints"]}
    assert ports == {"metrics", "http"}
    assert ports <= {p["name"] for p in service["spec"]["ports"]}


def test_workers_are_outside_the_services():
    lws = find("overlays/multinode-gpu", "LeaderWorkerSet", "tritonlm")
    workers = lws["spec"]["leaderWorkerTemplate"]["workerTemplate"]["metadata"]["labels"]
    for selector in (find("overlays/multinode-gpu", "Service", "tritonlm")["spec"]["selector"],
                     find("overlays/multinode-gpu", "InferencePool", "tritonlm")
                     ["spec"]["selector"]["matchLabels"]):
        assert not selects(selector, workers)


@pytest.mark.parametrize("build", BUILDS[1:])
def test_inference_pool_routes_to_the_front_ends_through_the_endpoint_picker(build):
    pod = serving_pod(build)
    pool = find(build, "InferencePool", "tritonlm")["spec"]
    assert selects(pool["selector"]["matchLabels"], pod["metadata"]["labels"])
    assert pool["targetPorts"] == [{"number": port_number(container(pod, "frontend"), "http")}]
    picker_ref = pool["endpointPickerRef"]
    picker_service = find(build, "Service", picker_ref["name"])
    picker = find(build, "Deployment", picker_ref["name"])
    (grpc,) = [p for p in picker_service["spec"]["ports"]
               if p["port"] == picker_ref["port"]["number"]]
    assert selects(picker_service["spec"]["selector"],
                   picker["spec"]["template"]["metadata"]["labels"])
    assert port_number(container(picker["spec"]["template"], "epp"), "grpc") == grpc["port"]
    route = find(build, "HTTPRoute", "tritonlm")["spec"]
    (rule,) = route["rules"]
    assert rule["backendRefs"] == [{"group": "inference.networking.k8s.io",
                                    "kind": "InferencePool", "name": "tritonlm"}]


@pytest.fixture(scope="module")
def exported_metrics() -> dict[str, set[str]]:
    """tritonlm's metric families and the label names of their series, as its model registers
    them with the Python backend's metric API (here a stand-in that records them)."""
    exported: dict[str, set[str]] = {}

    class MetricFamily:
        GAUGE, COUNTER, HISTOGRAM = "gauge", "counter", "histogram"

        def __init__(self, name, description, kind):
            self.name = name
            exported.setdefault(name, set())

        def Metric(self, labels, buckets=None):  # noqa: N802 (the backend's spelling)
            exported[self.name] |= labels.keys()
            return self

        def set(self, value):
            pass

    path = ROOT / "backend_src" / "tritonlm" / "triton" / "metrics.py"
    spec = importlib.util.spec_from_file_location("tritonlm_metrics_under_test", path)
    module = importlib.util.module_from_spec(spec)
    backend = types.ModuleType("triton_python_backend_utils")
    backend.MetricFamily = MetricFamily
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(sys.modules, backend.__name__, backend)
        spec.loader.exec_module(module)
    metrics = module.TritonMetrics(MODEL, "1", 4096, {}, max_loras=4)
    metrics.on_step(StepStats(num_running=1, num_waiting=2, num_preempted_waiting=0,
                              kv_blocks_used=3, kv_blocks_total=8, num_preemptions=0,
                              prefix_cache_queries=0, prefix_cache_hits=0,
                              running_adapters=("sql",)))
    return exported


@pytest.mark.parametrize("build", BUILDS[1:])
def test_endpoint_picker_reads_metrics_tritonlm_exports(build, exported_metrics):
    picker = container(find(build, "Deployment", "tritonlm-endpoint-picker")["spec"]["template"],
                       "epp")
    flags = dict(arg.split("=", 1) for arg in picker["args"])
    assert flags["--pool-name"] == "tritonlm"
    for flag, metric in {"--total-queued-requests-metric": "tritonlm:num_requests_waiting",
                         "--total-running-requests-metric": "tritonlm:num_requests_running",
                         "--kv-cache-usage-percentage-metric": "tritonlm:kv_cache_usage_perc",
                         "--lora-info-metric": "tritonlm:lora_requests_info"}.items():
        assert flags[flag] == metric and metric in exported_metrics
    # the labels the picker reads as vLLM's lora_requests_info
    assert {"running_lora_adapters", "waiting_lora_adapters", "max_lora"} <= exported_metrics[
        "tritonlm:lora_requests_info"]
    # tritonlm has no vLLM cache_config_info: the picker must not look for one
    assert flags["--cache-info-metric"] == ""
    config_file = Path(flags["--config-file"])
    (config_map,) = [o for o in objects(build) if o["kind"] == "ConfigMap"
                     and config_file.name in o.get("data", {})]
    config = yaml.safe_load(config_map["data"][config_file.name])
    scorers = {plugin["type"] for plugin in config["plugins"]}
    assert {"queue-scorer", "kv-cache-utilization-scorer", "prefix-cache-scorer",
            "lora-affinity-scorer"} <= scorers
    (profile,) = config["schedulingProfiles"]
    assert {p["pluginRef"] for p in profile["plugins"]} == scorers


@pytest.mark.parametrize("build", BUILDS[1:])
def test_autoscaling_on_waiting_requests(build, exported_metrics):
    scaled = find(build, "ScaledObject", "tritonlm")["spec"]
    (trigger,) = scaled["triggers"]
    assert trigger["type"] == "prometheus"
    assert re.findall(r"[a-zA-Z_:][a-zA-Z0-9_:]*(?=\{)", trigger["metadata"]["query"]) == [
        "tritonlm:num_requests_waiting"]
    assert "tritonlm:num_requests_waiting" in exported_metrics
    target = scaled["scaleTargetRef"]
    kind = target.get("kind", "Deployment")  # KEDA's default
    assert find(build, kind, target["name"])["apiVersion"] == target.get("apiVersion", "apps/v1")


def test_leaderworkerset_runs_rank_0_and_tritonlm_workers(monkeypatch):
    group = find("overlays/multinode-gpu", "LeaderWorkerSet", "tritonlm")["spec"][
        "leaderWorkerTemplate"]
    assert group["restartPolicy"] == "RecreateGroupOnPodRestart"  # a worker's death: new group
    leader = env(container(group["leaderTemplate"], "tritonserver"))
    assert leader[EXTERNAL_WORKERS_VARIABLE] == "1"
    assert leader["MASTER_ADDR"] == "$(LWS_LEADER_ADDRESS)"
    worker_container = container(group["workerTemplate"], "worker")
    workers = env(worker_container)
    for settings in (leader, workers):
        assert f"--tp {group['size']}" in settings["CONVERT_ARGS"]
        assert settings["MASTER_PORT"] == leader["MASTER_PORT"]
    # The worker's command line as Kubernetes expands it in the second pod of group 0, parsed
    # by tritonlm-worker itself.
    pod_env = {**workers, "LWS_LEADER_ADDRESS": "tritonlm-0.tritonlm.default",
               "LWS_GROUP_SIZE": str(group["size"]), "LWS_WORKER_INDEX": "1"}
    argv = [re.sub(r"\$\((\w+)\)", lambda m: pod_env[m.group(1)], arg)
            for arg in worker_container["args"]]
    assert worker_container["command"] == ["sh", "/etc/tritonlm/entrypoint.sh"]
    assert argv[0] == "tritonlm-worker"

    class Parsed(Exception):
        pass

    def load_runner(model_dir, rank, world_size, init_method, **settings):
        raise Parsed(model_dir, rank, world_size, init_method, settings)

    monkeypatch.setattr(worker, "_load_runner", load_runner)
    with pytest.raises(Parsed) as parsed:
        worker.main(argv[1:])
    assert parsed.value.args == (f"/models/{MODEL}/1", 1, group["size"],
                                 f"tcp://tritonlm-0.tritonlm.default:{leader['MASTER_PORT']}",
                                 {"device": "cuda:0"})


def test_object_storage_replaces_the_conversion():
    pod = find("overlays/gpu + components/object-storage", "Deployment", "tritonlm")[
        "spec"]["template"]
    server = container(pod, "tritonserver")
    assert env(server)["MODEL_REPOSITORY"].startswith("s3://")
    assert env(server)["MODEL_SOURCE"] == ""
    assert server["envFrom"] == [{"secretRef": {"name": "tritonlm-object-storage"}}]
    assert "model-source" not in {v["name"] for v in pod["spec"]["volumes"]}


def run_entrypoint(repository: Path, source: str, *command: str) -> str:
    """The entrypoint as the container runs it, with this venv's tritonlm-convert on PATH."""
    result = subprocess.run(
        ["sh", str(ENTRYPOINT), *command], capture_output=True, text=True, timeout=300,
        env={**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
             "MODEL_REPOSITORY": str(repository), "MODEL_SOURCE": source,
             "CONVERT_ARGS": "--instance-kind KIND_CPU --kv-cache-memory 64MiB"})
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_entrypoint_converts_once_then_runs_the_command(tmp_path):
    repository = tmp_path / "models"
    first = run_entrypoint(repository, "default", "echo", "serving")
    config = repository / MODEL / "config.pbtxt"
    engine = json.loads((repository / MODEL / "1" / "engine.json").read_text())
    assert engine["kv_cache_memory"] == 64 << 20  # CONVERT_ARGS, split into options
    assert "KIND_CPU" in config.read_text()
    assert first.splitlines()[-1] == "serving"
    converted_at = config.stat().st_mtime_ns
    again = run_entrypoint(repository, "default", "echo", "serving")
    assert "converted already" in again and again.splitlines()[-1] == "serving"
    assert config.stat().st_mtime_ns == converted_at


def test_entrypoint_without_a_source_serves_the_repository_as_it_is(tmp_path):
    output = run_entrypoint(tmp_path, "", "echo", "serving")
    assert output.splitlines() == [f"entrypoint: no MODEL_SOURCE; serving {tmp_path} as it is",
                                   "serving"]
    assert list(tmp_path.iterdir()) == []
