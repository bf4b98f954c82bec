"""Reading config files: YAML in, one clear line out when it is wrong (file, field, problem)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, ValidationError

from palimpsest.platform.types import ConfigError


class StrictSection(BaseModel):
    """A config section that refuses unknown fields and never changes once read (every YAML config's base)."""

    model_config = ConfigDict(extra="forbid", frozen=True)


def read_yaml(path: str | Path, what: str) -> Any:
    p = Path(path)
    try:
        return yaml.safe_load(p.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{what} not found: {p}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{p} is not valid YAML: {e}") from None


def problems(e: ValidationError, skip: int = 0) -> str:
    """'field.sub: message; ...' for every error (``skip`` drops leading location parts, e.g. a union tag)."""
    return "; ".join(f"{'.'.join(str(x) for x in err['loc'][skip:]) or 'config'}: {err['msg']}" for err in e.errors())
