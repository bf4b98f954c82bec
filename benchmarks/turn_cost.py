"""Model cost of one turn on one device: the memory encoder (actor hidden states over the history + the
REMORY memory network) and the actor (prefill of the compiled context, then decoding), for actor shapes
from the SmolLM2-135M this project tests with up to an 8B Llama. Feeds the capacity model in docs/scaling.md.

The weights are random (cost depends on the shapes, not the values), so no checkpoint is needed; the actor
runs through Hugging Face transformers (eager PyTorch + SDPA), an upper bound on what vLLM's paged kernels
take for the same shapes. Device and dtype come from the command line:

    python benchmarks/turn_cost.py --device cuda --dtype bfloat16        # a GPU node
    python benchmarks/turn_cost.py --device cpu --dtype float32 --shapes smollm2-135m --contexts 1024 4096
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

SHAPES = {  # LlamaConfig fields of the published models
    "smollm2-135m": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                         num_key_value_heads=3, vocab_size=49152),
    "llama-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                     num_key_value_heads=8, vocab_size=128256),
}


def timed(fn, device: str, repeat: int) -> dict:
    fn()  # warm-up (kernels, allocator)
    times = []
    for _ in range(repeat):
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1000)
    return {"p50_ms": round(statistics.median(times), 2), "min_ms": round(min(times), 2)}


@torch.inference_mode()
def one_shape(name: str, device: str, dtype: torch.dtype, contexts: list[int], histories: list[int],
              decode: int, repeat: int) -> dict:
    from transformers import LlamaConfig, LlamaForCausalLM

    from palimpsest.models.actor import FrozenActor
    from palimpsest.models.memory import MemoryConfig
    from palimpsest.models.memory_network import MemoryNetwork

    cfg = LlamaConfig(**SHAPES[name], max_position_embeddings=max(contexts + histories) + decode + 8,
                      attn_implementation="sdpa", tie_word_embeddings=name == "smollm2-135m")
    with torch.device(device):
        model = LlamaForCausalLM(cfg).to(dtype).eval()
    actor = FrozenActor(model)
    params = sum(p.numel() for p in model.parameters())
    # A memory network of the demo config's kind (the actor's own layers with LoRA), 512-id blocks to 64 soft tokens.
    mcfg = MemoryConfig(block_size=512, queries=64, max_slots=512)
    memory = MemoryNetwork(mcfg, actor).to(dtype).eval()
    out: dict = {"actor_params": params, "memory_params": sum(p.numel() for p in memory.parameters()),
                 "memory_encode": {}, "prefill": {}, "decode": {}}
    gen = torch.Generator(device="cpu").manual_seed(0)

    def ids(n: int) -> torch.Tensor:
        return torch.randint(0, cfg.vocab_size, (n,), generator=gen).to(device)

    for h in histories:
        hist = ids(h)
        out["memory_encode"][h] = timed(lambda: memory(hist, None), device, repeat)
    for n in contexts:
        ctx = ids(n)[None]
        out["prefill"][n] = timed(lambda: model(input_ids=ctx, use_cache=True), device, repeat)
        pre = model(input_ids=ctx, use_cache=True)

        def step_loop():
            past, tok = pre.past_key_values, ctx[:, -1:]
            for _ in range(decode):
                o = model(input_ids=tok, past_key_values=past, use_cache=True)
                past, tok = o.past_key_values, o.logits[:, -1:].argmax(-1)

        # decoding mutates the cache: a fresh prefill per measurement keeps the context length fixed
        def fresh_decode():
            nonlocal pre
            pre = model(input_ids=ctx, use_cache=True)
            step_loop()

        d = timed(fresh_decode, device, max(1, repeat // 2))
        p = out["prefill"][n]["p50_ms"]
        out["decode"][n] = {"tokens": decode, "ms_per_token": round((d["p50_ms"] - p) / decode, 2)}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--contexts", type=int, nargs="+", default=[4096, 16384, 32768])
    ap.add_argument("--histories", type=int, nargs="+", default=[1024, 8192])
    ap.add_argument("--decode", type=int, default=32)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--out", default="benchmarks/results/turn_cost.json")
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    device_name = torch.cuda.get_device_name(0) if args.device.startswith("cuda") else platform.processor() or "cpu"
    result = {"device": args.device, "device_name": device_name, "dtype": args.dtype, "torch": torch.__version__,
              "python": platform.python_version(), "shapes": {}}
    for name in args.shapes:
        result["shapes"][name] = one_shape(name, args.device, dtype, args.contexts, args.histories, args.decode,
                                           args.repeat)
        print(name, json.dumps(result["shapes"][name]), flush=True)
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()  # this shape's weights and caches are out of scope now
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
