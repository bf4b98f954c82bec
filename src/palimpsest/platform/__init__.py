"""The pure core of Palimpsest: the ledger, the prompt, compiling a turn, the policies and the runtime.

Importing this package loads no torch, ray, vllm, deepspeed or mlflow (a test checks it).
"""

from palimpsest.platform.compile.budget import Budget
from palimpsest.platform.compile.compiler import compile_plan
from palimpsest.platform.embedding import Embedder, HashingEmbedder
from palimpsest.platform.ledger import Ledger, SessionSnapshot
from palimpsest.platform.policies import build_policy, parse_policy_config, policy_names
from palimpsest.platform.prompt.abstraction import Abstraction, RuleSummarizer, abstract_step
from palimpsest.platform.prompt.tokens import ApproxTokenizer, HFTokenizer, Tokenizer, get_tokenizer
from palimpsest.platform.runtime import Runtime
from palimpsest.platform.types import (
    Authority,
    BudgetError,
    CompiledTurn,
    ConfigError,
    GlimpseLimitError,
    LedgerError,
    LedgerUnavailableError,
    PalimpsestError,
    Prompt,
    RenderPlan,
    Resolution,
    Session,
    Step,
    StepRecord,
    UnknownSessionError,
    UnknownStepError,
)

__all__ = [
    "Abstraction", "ApproxTokenizer", "Authority", "Budget", "BudgetError", "CompiledTurn", "ConfigError",
    "Embedder", "GlimpseLimitError", "HFTokenizer", "HashingEmbedder", "Ledger", "LedgerError",
    "LedgerUnavailableError", "PalimpsestError", "Prompt", "RenderPlan", "Resolution", "RuleSummarizer", "Runtime",
    "Session", "SessionSnapshot", "Step", "StepRecord", "Tokenizer", "UnknownSessionError", "UnknownStepError",
    "abstract_step", "build_policy", "compile_plan", "get_tokenizer", "parse_policy_config", "policy_names",
]
