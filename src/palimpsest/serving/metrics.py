"""Prometheus metrics of the ingress, per arm: turns, context tokens, latency by stage, glimpses,
errors, outcomes; per candidate arm: its rollout stage, the decisions taken and its paired shadow records. One
registry per replica (Prometheus scrapes each replica's /metrics)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_MS_BUCKETS = (5, 10, 25, 50, 100, 250, 500, 1000, 2500, 5000, 10000, 30000, 60000)
_TOKEN_BUCKETS = (256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536)


class Metrics:
    def __init__(self, arms: list[str]):
        self.registry = CollectorRegistry()
        r = self.registry
        self.turns = Counter("palimpsest_turns", "served turns", ["arm"], registry=r)
        self.latency = Histogram("palimpsest_turn_latency_ms", "turn latency by stage (plan = plan+compile)",
                                 ["arm", "stage"], buckets=_MS_BUCKETS, registry=r)
        self.context = Histogram("palimpsest_context_tokens", "compiled context tokens per turn", ["arm"],
                                 buckets=_TOKEN_BUCKETS, registry=r)
        self.soft = Counter("palimpsest_soft_tokens", "soft-memory positions sent to the actor", ["arm"], registry=r)
        self.cached = Counter("palimpsest_prefix_cached_tokens", "prompt tokens served from the actor's prefix cache",
                              ["arm"], registry=r)
        self.prompt = Counter("palimpsest_prompt_tokens", "prompt tokens sent to the actor", ["arm"], registry=r)
        self.glimpses = Counter("palimpsest_glimpses", "glimpses made by the model", ["arm"], registry=r)
        self.fallbacks = Counter("palimpsest_fallbacks", "turns served on a fallback (e.g. the embedder down)",
                                 ["arm", "kind"], registry=r)
        self.errors = Counter("palimpsest_errors", "failed turns and background jobs", ["arm", "kind"], registry=r)
        self.shadow = Counter("palimpsest_shadow_samples", "turns sampled for shadow fidelity, by status (scored, "
                              "identical, skipped)", ["arm", "status"], registry=r)
        self.outcomes = Histogram("palimpsest_outcome", "outcome values posted by clients", ["arm"],
                                  buckets=(0.0, 0.25, 0.5, 0.75, 1.0), registry=r)
        self.pairs = Counter("palimpsest_shadow_pairs", "a candidate judged on its control's live turns, by status "
                             "(scored, skipped)", ["candidate", "status"], registry=r)
        self.stage = Gauge("palimpsest_rollout_stage", "a candidate arm's rollout stage (1 on the stage in force)",
                           ["candidate", "control", "stage"], registry=r)
        self.decisions = Counter("palimpsest_rollout_decisions", "rollout decisions this replica took, by the "
                                 "stage they moved a candidate to", ["candidate", "stage"], registry=r)
        for a in arms:  # every arm shows up (with zeros) before its first turn
            self.turns.labels(arm=a)
            self.glimpses.labels(arm=a)

    def observe_turn(self, arm: str, tokens: dict, latency: dict, glimpses: int) -> None:
        self.turns.labels(arm=arm).inc()
        for stage, ms in latency.items():
            self.latency.labels(arm=arm, stage=stage).observe(ms)
        self.context.labels(arm=arm).observe(tokens["context"])
        self.soft.labels(arm=arm).inc(tokens["soft"])
        self.cached.labels(arm=arm).inc(tokens["cached"])
        self.prompt.labels(arm=arm).inc(tokens["prompt"])
        self.glimpses.labels(arm=arm).inc(glimpses)

    def observe_stages(self, stages: dict[str, tuple[str, str]]) -> None:
        """Each candidate's stage in force (name -> (control, stage)): 1 on it, 0 on the others."""
        for name, (control, stage) in stages.items():
            for s in ("dark", "canary", "promoted", "withdrawn"):
                self.stage.labels(candidate=name, control=control, stage=s).set(1.0 if s == stage else 0.0)

    def render(self) -> str:
        return generate_latest(self.registry).decode()
