"""A tiny actor on disk (random Llama + byte-level BPE, vLLM loads it) and a composed app over it, shared by
the end-to-end tests of a module (starting vLLM inside Serve costs ~40 s)."""

from __future__ import annotations

import hashlib
import json
import socket

import pytest
import torch

from palimpsest.serving.serve_config import HERMES_TEMPLATE as HERMES
from tests.models.tiny import tiny_actor
from tests.models.tiny_tokenizer import tiny_tokenizer

HIDDEN = 128  # vLLM's CPU attention needs head_dim >= 32: 2 heads of 64
KEYS = {"alice": "alice-secret-key", "bob": "bob-secret-key"}


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny-actor")
    # The model's vocabulary covers the tokenizer's (256 bytes + 2 special tokens), as real checkpoints' do.
    actor = tiny_actor(seed=3, hidden=HIDDEN, vocab=320, heads=2)
    actor.model.save_pretrained(d)
    tiny_tokenizer().save_pretrained(d)
    return d


@pytest.fixture(scope="session")
def tiny_memory(tiny_dir, tmp_path_factory):
    """A memory bundle for the tiny actor, as training exports it (random weights: the plumbing is under test)."""
    from palimpsest.models.actor import FrozenActor
    from palimpsest.models.memory import MemoryConfig
    from palimpsest.models.memory_network import MemoryNetwork
    from palimpsest.models.registry import BUNDLE_META, BUNDLE_WEIGHTS, bundle_record

    actor = FrozenActor.from_pretrained(tiny_dir)
    # the span gate open (its starting logit +4): served turns carry the span, through the gate's code path
    cfg = MemoryConfig(block_size=32, queries=4, max_slots=16, lora_rank=4, summary_layers=1, gate_bias=4.0)
    torch.manual_seed(0)
    net = MemoryNetwork(cfg, actor)
    d = tmp_path_factory.mktemp("tiny-memory")
    torch.save(net.state_dict(), d / BUNDLE_WEIGHTS)
    meta = bundle_record(cfg.to_dict(), {"path": str(tiny_dir), "hidden_size": HIDDEN, "layers": 2},
                         data={"memory_tokens": 256, "max_observation_chars": 400})  # what it reads of a turn
    (d / BUNDLE_META).write_text(json.dumps(meta))
    return d


@pytest.fixture(scope="session")
def tiny_relevance(tmp_path_factory):
    """A relevance predictor's bundle as `palimpsest train-relevance` writes it: a logistic regression over the
    scalar features with fixed, distinct weights (a served boundary must rank old steps by exactly these)."""
    import numpy as np

    from palimpsest.models.relevance_head import write_head
    from palimpsest.platform.policies.relevance import SCALARS, RelevanceHead

    f = len(SCALARS)
    head = RelevanceHead(mean=np.zeros(f), scale=np.ones(f), w1=np.zeros((0, 0)), b1=np.zeros(0),
                         w2=np.linspace(-1.5, 2.0, f), b2=-0.5, meta={"recent": 2})
    return write_head(tmp_path_factory.mktemp("tiny-relevance"), head)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tiny_config(tiny_dir, memory_dir, ledger, shadow_rate: float = 0.0, relevance_dir=None) -> dict:
    learned = [{"name": "learned-relevance", "policy": {"type": "pace", "relevance": {"model": str(relevance_dir)}},
                "weight": 0.0}] if relevance_dir else []
    return {
        "ledger": str(ledger), "embedder": "hashing", "budget": 900,
        "actor": {"model": str(tiny_dir), "max_model_len": 2048, "max_tokens": 6, "max_embeds_len": 2048,
                  "chat_template": str(HERMES), "tool_parser": "hermes"},
        "summarizer": {"mode": "llm", "timeout_s": 10, "max_tokens": 16},
        "memory": {"model": str(memory_dir)},  # it reads what its bundle says (256 tokens)
        "arms": [{"name": "pace", "policy": {"type": "pace"}, "weight": 1.0},
                 {"name": "pace+memory", "policy": {"type": "pace"}, "memory": True, "weight": 1.0},
                 {"name": "memory-b", "policy": {"type": "pace"}, "memory": True, "memory_model": str(memory_dir),
                  "weight": 0.0},
                 {"name": "ace-llm", "policy": {"type": "ace", "elasticizer": "llm", "llm_window": 4}, "weight": 0.0},
                 # tool declarations cost ~750 byte-level tokens of the tiny tokenizer: a wider budget
                 {"name": "wide", "policy": {"type": "pace"}, "budget": 2000, "weight": 0.0},
                 # plans every turn anew (a turn inside an epoch plans nothing, so embeds nothing)
                 {"name": "per-turn", "policy": {"type": "pace", "compaction": {"mode": "per_turn"}}, "weight": 0.0},
                 *learned],
        "limits": {"max_step_chars": 20_000, "glimpses_per_turn": 3},
        "ab": {"shadow_rate": shadow_rate, "shadow_queue": 8},
        "auth": {"tenants": {
            "alice": {"key_sha256": hashlib.sha256(KEYS["alice"].encode()).hexdigest(), "allow_prompt_embeds": True},
            "bob": {"key_sha256": hashlib.sha256(KEYS["bob"].encode()).hexdigest()}}},
    }


@pytest.fixture(scope="module")
def shadow_rate() -> float:
    """The share of turns the module's app scores for shadow fidelity (a module overrides it)."""
    return 0.0


@pytest.fixture(scope="module")
def serve_overrides() -> dict:
    """Sections of the serve config the module's app sets otherwise (merged into each section; a module
    overrides it)."""
    return {}


@pytest.fixture(scope="module")
def server(tiny_dir, tiny_memory, tiny_relevance, tmp_path_factory, shadow_rate, serve_overrides):
    """One app per test module: it is shut down (Serve and Ray) before the next module, so later tiers (Ray
    Train needs every CPU of this machine) never run beside it."""
    from palimpsest.serving.local import LocalServer

    ledger = tmp_path_factory.mktemp("serve") / "ledger.db"
    cfg = tiny_config(tiny_dir, tiny_memory, ledger, shadow_rate, relevance_dir=tiny_relevance)
    for section, values in serve_overrides.items():
        cfg[section] = {**cfg.get(section, {}), **values}
    srv = LocalServer(cfg, port=free_port())
    srv.start(timeout_s=600)
    yield srv
    srv.stop()
