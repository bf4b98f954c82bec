"""Every YAML under configs/ loads and validates (and the policy files equal the code's defaults)."""

from pathlib import Path

import pytest
import yaml

from palimpsest.platform.policies import default_configs, load_policy_file

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("policies/*.yaml")), ids=lambda p: p.name)
def test_policy_configs_load_and_match_the_defaults(path):
    cfg = load_policy_file(path)
    assert cfg == default_configs()[cfg.type] and path.stem == cfg.type


def test_every_policy_has_a_default_config_file():
    assert {p.stem for p in CONFIGS.glob("policies/*.yaml")} == set(default_configs())


@pytest.mark.parametrize("path", sorted(CONFIGS.rglob("*.yaml")), ids=lambda p: str(p.relative_to(CONFIGS)))
def test_every_yaml_parses(path):
    assert isinstance(yaml.safe_load(path.read_text()), dict)


def test_a_broken_config_file_names_the_file_and_the_field(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("type: pace\ntau: -1\n")
    from palimpsest.platform import ConfigError

    with pytest.raises(ConfigError, match=r"bad.yaml: invalid pace policy config: tau"):
        load_policy_file(bad)


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("serve/*.yaml")), ids=lambda p: p.name)
def test_serve_configs_validate(path):
    from palimpsest.serving.serve_config import load_serve_config

    cfg = load_serve_config(path)
    # the demo serves pace (its dark candidate is added by the demo: the registered memory when it fits its budget)
    assert {a.name for a in cfg.arms} == ({"pace"} if path.name == "demo.yaml" else {"pace", "pace+memory"})
    data = yaml.safe_load(path.read_text())
    if "applications" in data:  # a `serve run` / `serve deploy` file: Ray's own schema accepts it
        from ray.serve.schema import ServeDeploySchema

        schema = (ServeDeploySchema.model_validate(data) if hasattr(ServeDeploySchema, "model_validate")
                  else ServeDeploySchema.parse_obj(data))
        app = schema.applications[0]
        assert app.import_path == "palimpsest.serving.app:app_builder" and data["http_options"]["host"] == "127.0.0.1"


@pytest.mark.parametrize("bad, match", [
    ({"arms": []}, "at least one arm"),
    ({"arms": [{"name": "a"}, {"name": "a"}]}, "unique"),
    ({"arms": [{"name": "a", "weight": 0}]}, "positive weight"),
    ({"arms": [{"name": "a", "policy": {"type": "magic"}}]}, "magic"),
    ({"arms": [{"name": "bad name!"}]}, "arm name"),
    ({"budget": 0}, "budget"),
    ({"actor": {"dtype": "int8"}}, "dtype"),
    ({"colour": "blue"}, "colour"),
    # what the memory reads of a turn is its bundle's (MemoryBundle.read), not a serve field to get wrong
    ({"memory": {"max_history_tokens": 512}}, "memory.max_history_tokens"),
    ({"memory": {"max_field_chars": 300}}, "memory.max_field_chars"),
])
def test_bad_serve_configs_are_refused_before_anything_starts(bad, match):
    from palimpsest.platform import ConfigError
    from palimpsest.serving.serve_config import parse_serve_config

    with pytest.raises(ConfigError, match=match):
        parse_serve_config(bad)


def test_listening_beyond_loopback_needs_api_keys(tmp_path):
    import hashlib

    from palimpsest.platform import ConfigError
    from palimpsest.serving.serve_config import parse_serve_config

    open_cfg = parse_serve_config({})
    open_cfg.check_exposure("127.0.0.1")
    with pytest.raises(ConfigError, match="needs API keys"):
        open_cfg.check_exposure("0.0.0.0")
    (tmp_path / "tenants.yaml").write_text(f"tenants:\n  acme: {{key_sha256: {hashlib.sha256(b'k').hexdigest()}}}\n")
    keyed = parse_serve_config({"auth": {"tenants_file": str(tmp_path / "tenants.yaml")}})
    keyed.check_exposure("0.0.0.0")
    assert set(keyed.auth.resolved()) == {"acme"}
    with pytest.raises(ConfigError, match="key_sha256"):
        parse_serve_config({"auth": {"tenants": {"acme": {"key_sha256": "plaintext-key"}}}})


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("replay/*.yaml")), ids=lambda p: p.name)
def test_replay_variant_files_hold_valid_policy_configs(path):
    from palimpsest.platform.policies import parse_policy_config

    variants = yaml.safe_load(path.read_text())
    assert variants and all(parse_policy_config(body).type for body in variants.values())


@pytest.mark.parametrize("patch,field", [({"budget": 9000}, "budget: 9000 tokens exceeds the actor's window"),
                                         ({"arms": [{"name": "a", "budget": 10_000}]}, "arms.a.budget"),
                                         ({"budget": 100, "actor": {"max_tokens": 128}}, "leaves no room")])
def test_a_budget_beyond_the_actors_window_is_a_config_error(patch, field):
    from palimpsest.platform import ConfigError
    from palimpsest.serving.serve_config import parse_serve_config

    with pytest.raises(ConfigError, match=field):
        parse_serve_config({"actor": {"max_model_len": 8192}, **patch})


def test_the_embedded_serve_default_is_the_complete_local_configuration(monkeypatch):
    """`palimpsest serve` with no config is what configs/serve/local.yaml spells out, tools and all."""
    from palimpsest.serving.serve_config import ActorConfig, ServeConfig, load_serve_config

    monkeypatch.chdir(CONFIGS.parent)  # the file names its template relative to the checkout
    embedded = ServeConfig()
    assert embedded == load_serve_config(CONFIGS / "serve" / "local.yaml")
    assert embedded.actor.tool_parser == "hermes" and Path(embedded.actor.chat_template).is_file()
    assert "tools" in Path(embedded.actor.chat_template).read_text()
    # a template or parser named in a config, or another model, is taken as it is
    assert ActorConfig(chat_template=None).tool_parser is None
    assert ActorConfig(model="/models/other").chat_template is None


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("train/*.yaml")), ids=lambda p: p.name)
def test_train_configs_reach_the_data_builder_and_the_network_whole(path):
    """The ``data:`` section is the data builder's one config: what the builder gets is that section, with only
    the derived fields (soft slots, seed) filled in; its memory section is a valid MemoryConfig whole."""
    from palimpsest.models.memory import MemoryConfig
    from palimpsest.training.prepare import data_config
    from palimpsest.training.remory_data import DataConfig
    from palimpsest.training.train_config import load_train_config

    cfg = load_train_config(path)
    built = data_config(cfg)
    assert type(cfg.data) is DataConfig and type(built) is DataConfig
    derived = {"soft_slots", "seed"}
    assert built.model_dump(exclude=derived) == cfg.data.model_dump(exclude=derived)
    assert built.seed == cfg.optim.seed and built.soft_slots > 0
    assert isinstance(cfg.memory, MemoryConfig) and MemoryConfig(**cfg.memory.to_dict()) == cfg.memory
