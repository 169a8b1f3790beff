"""examples/ray/rayservice.yaml is a RayService that KubeRay accepts and that runs the app as
sized: it validates against KubeRay v1.7.0's own RayService schema (the CRD's
openAPIV3Schema, tests/data/kuberay, checked strictly: an unknown field is an error, as
`kubectl apply --validate=strict` makes it), its serveConfigV2 builds the Serve app, and its
worker pods hold what one replica of SmolLM2 needs by the KV and weight arithmetic of
`pagedserve kv` (settings.replica_memory_bytes)."""
from __future__ import annotations

import gzip
import json
import re
from pathlib import Path

import jsonschema
import pytest
import yaml

from pagedserve.entrypoints.ray_serve.app import build_app
from pagedserve.entrypoints.ray_serve.settings import RayServeConfig, replica_memory_bytes
from pagedserve.sim.kv_calc import kv_size
from pagedserve.sim.models import MODELS

ROOT = Path(__file__).resolve().parent.parent
MANIFEST = ROOT / "examples" / "ray" / "rayservice.yaml"
SCHEMA = ROOT / "tests" / "data" / "kuberay" / "rayservice-v1.7.0.schema.json.gz"
_UNITS = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "k": 10**3, "M": 10**6, "G": 10**9, "": 1}


def quantity(value: str) -> float:
    """A Kubernetes quantity: '4Gi' -> bytes, '500m' -> 0.5, '4' -> 4."""
    number, unit = re.fullmatch(r"([0-9.]+)(m|Ki|Mi|Gi|Ti|k|M|G|)", str(value)).groups()
    return float(number) / 1000 if unit == "m" else float(number) * _UNITS[unit]


def strict(schema: dict) -> dict:
    """Unknown fields become errors wherever the schema lists an object's fields."""
    if isinstance(schema, dict):
        schema = {k: strict(v) for k, v in schema.items()}
        if "properties" in schema and "additionalProperties" not in schema \
                and not schema.get("x-kubernetes-preserve-unknown-fields"):
            schema["additionalProperties"] = False
    elif isinstance(schema, list):
        schema = [strict(v) for v in schema]
    return schema


@pytest.fixture(scope="module")
def manifest() -> dict:
    return yaml.safe_load(MANIFEST.read_text())


@pytest.fixture(scope="module")
def validator() -> jsonschema.Validator:
    schema = json.loads(gzip.decompress(SCHEMA.read_bytes()))["schema"]
    return jsonschema.Draft7Validator(strict(schema))


def test_the_manifest_is_a_valid_rayservice(manifest, validator):
    assert (manifest["apiVersion"], manifest["kind"]) == ("ray.io/v1", "RayService")
    errors = [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(manifest)]
    assert not errors, errors
    # The check has teeth: a misspelt field and a wrong type are refused.
    broken = json.loads(json.dumps(manifest))
    broken["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["maxReplica"] = 4
    broken["spec"]["rayClusterConfig"]["headGroupSpec"]["rayStartParams"] = {"num-cpus": 0}
    assert len(list(validator.iter_errors(broken))) == 2


def test_the_serve_config_builds_the_app_and_the_pods_hold_its_replicas(manifest):
    (app,) = yaml.safe_load(manifest["spec"]["serveConfigV2"])["applications"]
    assert app["import_path"] == "pagedserve.entrypoints.ray_serve.app:build_app"
    assert type(build_app(app["args"])).__name__ == "Application"
    config = RayServeConfig.from_dict(app["args"])
    cluster = manifest["spec"]["rayClusterConfig"]
    (workers,) = cluster["workerGroupSpecs"]
    (container,) = workers["template"]["spec"]["containers"]
    requests = container["resources"]["requests"]
    model = MODELS["smollm2-135m"]
    needed = replica_memory_bytes(config, model)
    # One replica per worker pod: its CPUs are the pod's, its memory fits the pod's.
    assert quantity(workers["rayStartParams"]["num-cpus"]) == quantity(requests["cpu"]) == config.replicas.num_cpus
    assert needed <= quantity(requests["memory"]) < needed + (1 << 30)
    assert workers["minReplicas"] <= config.replicas.num_replicas <= workers["replicas"] <= workers["maxReplicas"]
    assert workers["maxReplicas"] >= config.replicas.max_replicas
    assert quantity(cluster["headGroupSpec"]["rayStartParams"]["num-cpus"]) == 0  # no replica on the head
    kv = kv_size(model.num_layers, model.num_kv_heads, model.head_dim, 4, config.server.engine.max_model_len,
                 config.server.engine.kv_cache_memory)
    assert kv.sequences_that_fit >= 4, kv.to_dict()  # the pool holds several full contexts
