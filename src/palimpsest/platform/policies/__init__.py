"""The policy registry: one discriminated union of configs, keyed by ``type``.

Adding a policy = one file with a config class (``type: Literal[...]``, ``build()``) and a class
with ``plan(snapshot, budget)``, plus one entry in ``_CONFIGS`` below.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Union

from pydantic import Field, TypeAdapter, ValidationError

from palimpsest.platform.config_files import problems, read_yaml
from palimpsest.platform.policies.ace import (
    AceConfig,
    AcePolicy,
    ElasticDecision,
    Elasticizer,
    RuleElasticizer,
)
from palimpsest.platform.policies.base import ContextPolicy, PolicyConfigBase, PolicyDeps
from palimpsest.platform.policies.clear_tool_uses import ClearToolUsesConfig
from palimpsest.platform.policies.full import FullConfig
from palimpsest.platform.policies.observation_masking import ObservationMaskingConfig
from palimpsest.platform.policies.pace import PaceConfig
from palimpsest.platform.policies.pace_plus import PacePlusConfig
from palimpsest.platform.policies.rolling_summary import RollingSummaryConfig
from palimpsest.platform.policies.window import WindowConfig
from palimpsest.platform.types import ConfigError

_CONFIGS = (FullConfig, WindowConfig, RollingSummaryConfig, PaceConfig, AceConfig, PacePlusConfig,
            ObservationMaskingConfig, ClearToolUsesConfig)

PolicyConfig = Annotated[Union[_CONFIGS], Field(discriminator="type")]  # type: ignore[valid-type]
_ADAPTER: TypeAdapter = TypeAdapter(PolicyConfig)


def policy_names() -> list[str]:
    return [c.name for c in _CONFIGS]


def parse_policy_config(data: Any) -> PolicyConfigBase:
    """A validated policy config from a dict (or a bare policy name). Errors name the problem."""
    if isinstance(data, str):
        data = {"type": data}
    if not isinstance(data, dict):
        raise ConfigError(f"a policy config must be a mapping with a 'type', got {type(data).__name__}")
    kind = data.get("type")
    if kind not in policy_names():
        raise ConfigError(f"unknown policy type {kind!r}; known: {', '.join(policy_names())}")
    try:
        return _ADAPTER.validate_python(data)
    except ValidationError as e:
        raise ConfigError(f"invalid {kind} policy config: {problems(e, skip=1)}") from None


def load_policy_file(path: str | Path) -> PolicyConfigBase:
    p = Path(path)
    data = read_yaml(p, "policy config")
    try:
        return parse_policy_config(data)
    except ConfigError as e:
        raise ConfigError(f"{p}: {e}") from None


def default_configs() -> dict[str, PolicyConfigBase]:
    return {c.name: c() for c in _CONFIGS}


def build_policy(config: PolicyConfigBase | dict | str, deps: PolicyDeps | None = None) -> ContextPolicy:
    cfg = config if isinstance(config, PolicyConfigBase) else parse_policy_config(config)
    return cfg.build(deps or PolicyDeps())


__all__ = [
    "AceConfig", "AcePolicy", "ClearToolUsesConfig", "ContextPolicy", "ElasticDecision", "Elasticizer", "FullConfig",
    "ObservationMaskingConfig", "PaceConfig", "PacePlusConfig", "PolicyConfig", "PolicyConfigBase", "PolicyDeps",
    "RollingSummaryConfig", "RuleElasticizer", "WindowConfig",
    "build_policy", "default_configs", "load_policy_file", "parse_policy_config", "policy_names",
]
