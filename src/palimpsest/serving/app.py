"""The composed application: ``build_app(config) -> Application``.

Four children bound into the ingress through DeploymentHandles::

    Ingress ──► Actor (vLLM, prompt embeds)
       │  ├──► Embedder (all-MiniLM-L6-v2)
       │  ├──► Summarizer ──► Actor
       │  └──► MemoryEncoder (REMORY) ──► (soft span straight into the Actor call)

`serve run configs/serve/local.yaml` and `serve deploy` call :func:`app_builder` with the config's ``args``;
`palimpsest serve` calls :func:`build_app` directly. CPU shares come from the config (fractions of a core
are bookkeeping on one machine: they must add up to what the node has or replicas stay pending).
"""

from __future__ import annotations

from typing import Any

from ray.serve import Application

from palimpsest.models.registry import resolve_actor_path
from palimpsest.pipelines.tracking import check, configure
from palimpsest.platform.ledger.backends import open_store
from palimpsest.serving.models.deployments import (
    Actor,
    EmbedderDeployment,
    RemoteActor,
    SummarizerDeployment,
    deployment_env,
)
from palimpsest.serving.models.memory_encoder import MemoryDeployment
from palimpsest.serving.serve_config import ServeConfig, parse_serve_config


def build_app(config: ServeConfig | dict | None = None) -> Application:
    # deferred: loads torch, fastapi
    from palimpsest.serving.http.ingress import Ingress

    cfg = parse_serve_config(config)
    preflight(cfg)
    actor_path = str(resolve_actor_path(cfg.actor.model))
    env = {"env_vars": deployment_env()}
    res, n = cfg.resources, cfg.replicas
    actor_opts: dict[str, Any] = {"num_cpus": res.actor, "runtime_env": env}
    if res.actor_gpus:
        actor_opts["num_gpus"] = res.actor_gpus
    actor_cls = RemoteActor if cfg.actor.remote is not None else Actor
    actor = actor_cls.options(num_replicas=n.actor, ray_actor_options=actor_opts).bind(
        cfg.actor.model_dump() | {"model": actor_path})
    embedder = EmbedderDeployment.options(num_replicas=n.embedder,
                                          ray_actor_options={"num_cpus": res.embedder, "runtime_env": env}).bind(
        cfg.embedder, cfg.device)
    summarizer = SummarizerDeployment.options(num_replicas=n.summarizer,
                                    ray_actor_options={"num_cpus": res.summarizer, "runtime_env": env}).bind(
        cfg.summarizer.model_dump(), actor, actor_path.rstrip("/").rsplit("/", 1)[-1])
    memory = MemoryDeployment.options(num_replicas=n.memory,
                                      ray_actor_options={"num_cpus": res.memory, "runtime_env": env}).bind(
        actor_path, cfg.memory_models(), cfg.device)
    spread = {"max_replicas_per_node": n.ingress_max_per_node} if n.ingress_max_per_node else {}
    return Ingress.options(num_replicas=n.ingress, ray_actor_options={"num_cpus": res.ingress, "runtime_env": env},
                           **spread).bind(cfg.model_dump(), actor, embedder, summarizer, memory)


def preflight(cfg: ServeConfig) -> None:
    """What the app depends on outside Ray, checked before anything starts: the ledger's database and
    the MLflow tracking server (when one is configured). Each failure names what it could not reach."""
    configure(cfg.tracking.uri, cfg.tracking.artifact_location)  # exported: every replica inherits it
    check()
    open_store(cfg.ledger, timeout_s=10.0, pool_size=1).close()  # reachable, and its schema migrated


def app_builder(args: dict[str, Any]) -> Application:
    """The entry point of `serve run` / `serve deploy` configs: ``args`` are ServeConfig fields."""
    return build_app(parse_serve_config(args, "serve config args"))
