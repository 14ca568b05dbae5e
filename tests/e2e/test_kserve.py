"""The KServe manifests (deploy/k8s/kserve/) against KServe's own API models, the ones its Python SDK generates
from the CRDs' OpenAPI spec (`kserve.models`, with Kubernetes' `kubernetes.client.models` for the pod parts):
every field must exist in the model (a typo is an error) and every required one be set. Then what they say:
protocol v2 over gRPC on 8001, a GPU, the runtime and model format matched, a grace period longer than the drain.
And the plain Deployment's probes and preStop against its drain."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
import yaml

from ..conftest import REPO

K8S = REPO / "deploy" / "k8s"
KSERVE = K8S / "kserve"

# Run apart from the test process: the kserve package registers its own copy of the v2 protocol's messages with
# protobuf, as voxserve.proto does here.
STRICT_LOAD = r'''
import json, re, sys
import yaml
from kserve import models as kserve_models
from kubernetes.client import models as k8s_models

PRIMITIVES = {"str": str, "int": int, "float": (int, float), "bool": bool}
KINDS = {("serving.kserve.io/v1alpha1", "ServingRuntime"): "V1alpha1ServingRuntime",
         ("serving.kserve.io/v1beta1", "InferenceService"): "V1beta1InferenceService"}

def build(data, type_name, path):
    if (m := re.fullmatch(r"[lL]ist\[(.*)\]", type_name)):  # list[X] (kserve), List[X] (kubernetes)
        assert isinstance(data, list), f"{path}: a list expected"
        return [build(v, m.group(1), f"{path}[{i}]") for i, v in enumerate(data)]
    if (m := re.fullmatch(r"dict\(str, (.*)\)|Dict\[str, (.*)\]", type_name)):
        assert isinstance(data, dict), f"{path}: a mapping expected"
        return {k: build(v, m.group(1) or m.group(2), f"{path}.{k}") for k, v in data.items()}
    if type_name in PRIMITIVES:
        ok = isinstance(data, PRIMITIVES[type_name]) and not (type_name != "bool" and isinstance(data, bool))
        assert ok, f"{path}: {type_name} expected, got {data!r}"
        return data
    if type_name in ("object", "datetime", "date"):
        return data
    cls = getattr(kserve_models, type_name, None) or getattr(k8s_models, type_name)
    assert isinstance(data, dict), f"{path}: a {type_name} mapping expected"
    fields = {json_name: attr for attr, json_name in cls.attribute_map.items()}
    unknown = sorted(set(data) - set(fields))
    assert not unknown, f"{path}: {type_name} has no field {unknown}"
    kwargs = {fields[k]: build(v, cls.openapi_types[fields[k]], f"{path}.{k}") for k, v in data.items()}
    return cls(**kwargs)  # the generated setters refuse a required field left unset

checked = []
for path in sys.argv[1:]:
    for doc in yaml.safe_load_all(open(path)):
        model = KINDS[(doc["apiVersion"], doc["kind"])]
        build(doc, model, f"{path}:{doc['kind']}")
        checked.append(model)
print(json.dumps(checked))
'''


def _kserve_available() -> bool:
    probe = subprocess.run([sys.executable, "-c", "import kserve.models, kubernetes.client.models"],
                           capture_output=True, timeout=120)
    return probe.returncode == 0


def _load(path):
    return yaml.safe_load(path.read_text())


def test_kserve_manifests_match_kserves_api_models(tmp_path):
    if not _kserve_available():
        pytest.skip("the kserve SDK is not installed (a test dependency: pip install -e '.[test]')")
    manifests = sorted(str(p) for p in KSERVE.glob("*.yaml"))
    proc = subprocess.run([sys.executable, "-c", STRICT_LOAD, *manifests], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(json.loads(proc.stdout)) == ["V1alpha1ServingRuntime", "V1beta1InferenceService"]
    # The strict load refuses what KServe would not accept: a misspelt field, a missing required one.
    bad = yaml.safe_load((KSERVE / "inferenceservice.yaml").read_text())
    bad["spec"]["predictor"]["model"]["protocolVersions"] = bad["spec"]["predictor"]["model"].pop("protocolVersion")
    (tmp_path / "typo.yaml").write_text(yaml.safe_dump(bad))
    runtime = yaml.safe_load((KSERVE / "servingruntime.yaml").read_text())
    del runtime["spec"]["containers"][0]["name"]  # V1Container.name is required
    (tmp_path / "missing.yaml").write_text(yaml.safe_dump(runtime))
    # (kubernetes' models check required fields with pydantic, or in their generated setters in older releases)
    for name, says in (("typo.yaml", r"has no field \['protocolVersions'\]"),
                       ("missing.yaml", r"V1Container\s+name\s+Field required|`name`, must not be `None`")):
        refused = subprocess.run([sys.executable, "-c", STRICT_LOAD, str(tmp_path / name)], capture_output=True,
                                 text=True, timeout=300)
        assert refused.returncode != 0 and re.search(says, refused.stderr), refused.stderr[-2000:]


def test_kserve_runtime_and_service_serve_v2_grpc_on_a_gpu_within_the_drain():
    runtime, service = _load(KSERVE / "servingruntime.yaml"), _load(KSERVE / "inferenceservice.yaml")
    spec = runtime["spec"]
    (container,) = spec["containers"]
    assert spec["protocolVersions"] == ["grpc-v2"]
    assert container["ports"] == [{"name": "h2c", "containerPort": 8001, "protocol": "TCP"}]  # gRPC, h2c
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert container["readinessProbe"]["grpc"]["port"] == 8001
    assert spec["annotations"]["prometheus.kserve.io/port"] == "8002"
    predictor = service["spec"]["predictor"]
    model = predictor["model"]
    assert model["runtime"] == runtime["metadata"]["name"] and model["protocolVersion"] == "grpc-v2"
    assert model["modelFormat"]["name"] in {f["name"] for f in spec["supportedModelFormats"]}
    assert model["resources"]["limits"]["nvidia.com/gpu"] == "1"
    args = container["args"]
    drain_s = float(args[args.index("--grace-period-s") + 1])
    assert predictor["terminationGracePeriodSeconds"] > drain_s


def test_the_deployments_probes_and_pre_stop_fit_the_drain():
    """The pod's deletion takes it out of the endpoints during the preStop pause, then SIGTERM starts the drain:
    the server reports not ready from then on (readiness) and must not be restarted by liveness before the drain
    is over, all within the termination grace period; startup allows for the weights and the warm-up."""
    deployment = _load(K8S / "deployment.yaml")
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    args = container["args"]
    drain_s = float(args[args.index("--grace-period-s") + 1])
    pre_stop_s = container["lifecycle"]["preStop"]["sleep"]["seconds"]
    assert pod["terminationGracePeriodSeconds"] > pre_stop_s + drain_s
    readiness, liveness = container["readinessProbe"], container["livenessProbe"]
    assert readiness["grpc"]["port"] == 8001  # grpc.health.v1: NOT_SERVING from the start of the drain
    assert liveness["periodSeconds"] * liveness["failureThreshold"] > pre_stop_s + drain_s
    startup = container["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 120
