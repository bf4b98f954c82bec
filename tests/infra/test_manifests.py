"""infra/ manifests validated offline against the KubeRay CRD schemas (strictly: unknown fields fail)."""

import copy
from pathlib import Path

import jsonschema
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CRDS = ROOT.parent / "shared" / "data" / "kuberay-crds"
KINDS = {"RayJob": "ray.io_rayjobs.yaml", "RayCluster": "ray.io_rayclusters.yaml",
         "RayService": "ray.io_rayservices.yaml"}


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
    from palimpsest.training.train_config import load_train_config

    doc = yaml.safe_load((ROOT / "infra" / "rayjob-remory.yaml").read_text())
    config = doc["spec"]["entrypoint"].split("--config", 1)[1].split()[0]
    cfg = load_train_config(ROOT / config)
    assert cfg.distributed.use_gpu and cfg.distributed.zero_stage == 3


@pytest.mark.parametrize("path", sorted((ROOT / "configs" / "train").glob("*.yaml")), ids=lambda p: p.name)
def test_training_configs_validate(path):
    from palimpsest.training.train_config import load_train_config

    assert load_train_config(path).name


def test_the_rayservice_deploys_a_serve_config_that_ray_and_palimpsest_accept():
    from ray.serve.schema import ServeDeploySchema

    from palimpsest.serving.serve_config import parse_serve_config

    doc = yaml.safe_load((ROOT / "infra" / "rayservice-palimpsest.yaml").read_text())
    serve_cfg = yaml.safe_load(doc["spec"]["serveConfigV2"])
    schema = ServeDeploySchema.model_validate(serve_cfg)
    (app,) = schema.applications
    assert app.import_path == "palimpsest.serving.app:app_builder"
    cfg = parse_serve_config(serve_cfg["applications"][0]["args"])
    assert cfg.resources.actor_gpus == 1.0 and cfg.actor.dtype == "bfloat16"
    assert serve_cfg["http_options"]["host"] == "0.0.0.0" and cfg.auth.tenants_file  # exposed: keys required
    # the registered memory joins as a dark candidate of pace: no user is served it until the gate promotes it
    memory = cfg.arm("pace+memory")
    assert memory.memory and memory.candidate_of == "pace" and (memory.stage or "dark") == "dark"
    served = [a.name for a in cfg.arms if a.candidate_of is None]
    assert served == ["pace"]
    for d in serve_cfg["applications"][0].get("deployments", []):  # live weights name served arms only
        assert set((d.get("user_config") or {}).get("weights", {})) <= set(served)
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


# -- the Dockerfile ----------------------------------------------------------------------------

LINTER = ROOT / ".cache" / "npm" / "node_modules" / ".bin" / "dockerfile-utils"  # scripts/install.sh installs it


def lint(path: Path) -> list[dict]:
    import json
    import os
    import subprocess

    if not LINTER.exists():
        if os.environ.get("CI"):
            pytest.fail(f"{LINTER} is missing (scripts/install.sh installs it with npm)")
        pytest.skip("dockerfile-utils is not installed (needs npm)")
    out = subprocess.run([str(LINTER), "lint", "--json", str(path)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout or "[]")


def test_the_dockerfile_lints_clean():
    assert lint(ROOT / "infra" / "Dockerfile") == []


def test_the_linter_reports_what_is_wrong(tmp_path):
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM ubuntu\nMAINTAINER someone\nCMD a\nCMD b\n")
    messages = " ".join(p["message"] for p in lint(bad))
    assert "MAINTAINER has been deprecated" in messages and "only be one CMD" in messages


def test_the_dockerfile_follows_the_project_rules():
    """A pinned base, a non-root user, and sources that exist (what the linter does not check)."""
    lines = [ln.strip() for ln in (ROOT / "infra" / "Dockerfile").read_text().splitlines()
             if ln.strip() and not ln.lstrip().startswith("#")]
    base = next(ln.split("=", 1)[1] for ln in lines if ln.startswith("ARG BASE="))
    assert ":" in base and not base.endswith(":latest"), base
    assert lines[-1].startswith("CMD [") and any(ln.startswith("USER ") and ln != "USER root" for ln in lines)
    assert not any(ln.startswith("ADD ") for ln in lines)
    for ln in lines:
        if ln.startswith("COPY "):
            for src in ln.split()[1:-1]:
                assert (ROOT / src).exists(), f"COPY source {src} does not exist"
    assert "requirements.txt" in " ".join(lines)
