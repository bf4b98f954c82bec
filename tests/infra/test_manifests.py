"""infra/ manifests validated offline against the KubeRay CRD schemas (strictly: unknown fields fail)."""

import copy
from pathlib import Path

import jsonschema
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CRDS = ROOT.parent / "shared" / "data" / "kuberay-crds"
KINDS = {"RayJob": "ray.io_rayjobs.yaml", "RayCluster": "ray.io_rayclusters.yaml", "RayService": "ray.io_rayservices.yaml"}


def strict(schema):
    """Kubernetes prunes unknown fields silently; here an unknown field is an error (a typo caught)."""
    s = copy.deepcopy(schema)

    def walk(node):
        if isinstance(node, dict):
            if "properties" in node and "additionalProperties" not in node \
                    and not node.get("x-kubernetes-preserve-unknown-fields"):
                node["additionalProperties"] = False
            for v in node.values():
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)

    walk(s)
    return s


def crd_schema(kind):
    crd = yaml.safe_load((CRDS / KINDS[kind]).read_text())
    (v1,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    return strict(v1["schema"]["openAPIV3Schema"])


MANIFESTS = sorted((ROOT / "infra").glob("*.yaml"))
needs_crds = pytest.mark.skipif(not CRDS.is_dir(), reason="the KubeRay CRD schemas are not beside this checkout")


@needs_crds
@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_manifest_matches_its_crd(path):
    doc = yaml.safe_load(path.read_text())
    assert doc["apiVersion"] == "ray.io/v1" and doc["kind"] in KINDS
    jsonschema.validate(doc, crd_schema(doc["kind"]))


@needs_crds
def test_the_validator_catches_a_typo():
    doc = yaml.safe_load((ROOT / "infra" / "rayjob-remory.yaml").read_text())
    doc["spec"]["shutdownAfterJobFinish"] = True  # missing "es"
    with pytest.raises(jsonschema.ValidationError, match="shutdownAfterJobFinish"):
        jsonschema.validate(doc, crd_schema("RayJob"))


def test_the_job_runs_a_training_config_that_validates():
    from palimpsest.training.config import load_train_config

    doc = yaml.safe_load((ROOT / "infra" / "rayjob-remory.yaml").read_text())
    config = doc["spec"]["entrypoint"].split("--config", 1)[1].split()[0]
    cfg = load_train_config(ROOT / config)
    assert cfg.distributed.use_gpu and cfg.distributed.zero_stage == 3


@pytest.mark.parametrize("path", sorted((ROOT / "configs" / "train").glob("*.yaml")), ids=lambda p: p.name)
def test_training_configs_validate(path):
    from palimpsest.training.config import load_train_config

    assert load_train_config(path).name


def test_the_rayservice_deploys_a_serve_config_that_ray_and_palimpsest_accept():
    from ray.serve.schema import ServeDeploySchema

    from palimpsest.serving.config import parse_serve_config

    doc = yaml.safe_load((ROOT / "infra" / "rayservice-palimpsest.yaml").read_text())
    serve_cfg = yaml.safe_load(doc["spec"]["serveConfigV2"])
    schema = ServeDeploySchema.model_validate(serve_cfg)
    (app,) = schema.applications
    assert app.import_path == "palimpsest.serving.app:app_builder"
    cfg = parse_serve_config(serve_cfg["applications"][0]["args"])
    assert cfg.resources.actor_gpus == 1.0 and cfg.actor.dtype == "bfloat16"
    assert serve_cfg["http_options"]["host"] == "0.0.0.0" and cfg.auth.tenants_file  # exposed: keys required
    import importlib

    module, attr = app.import_path.split(":")
    assert callable(getattr(importlib.import_module(module), attr))


def test_the_dockerfile_copies_what_exists_and_runs_the_serve_command():
    lines = [ln.strip() for ln in (ROOT / "infra" / "Dockerfile").read_text().splitlines()]
    for ln in lines:
        if ln.startswith("COPY "):
            for src in ln.split()[1:-1]:
                assert (ROOT / src).exists(), f"Dockerfile copies {src}, which is not in the repository"
    assert any(ln.startswith("FROM ") for ln in lines) and any(ln.startswith("USER ") for ln in lines)
    cmd = next(ln for ln in lines if ln.startswith("CMD "))
    assert "palimpsest" in cmd and "serve" in cmd
    config = cmd.split("--config", 1)[1].split('"')[2]
    assert (ROOT / config).is_file()
