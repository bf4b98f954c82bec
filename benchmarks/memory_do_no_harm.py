r"""What a soft span that carries nothing learned costs the actor, held out: the memory network as it starts
(LoRA B = 0, the readout at identity, seeded slots; the registered memory's architecture and config) in the
registered memory's slot, scored by `palimpsest eval-memory` on the trajectories the registered memory held out.

    .venv/bin/python benchmarks/memory_do_no_harm.py [--model models:/palimpsest-memory/latest] \
        [--data ../shared/data/trajectories/dev.jsonl] [--window 8192] [--max-boundaries 16] \
        [--span-gate on|off] [--out FILE]

``--span-gate off`` is the network without its span gate (what every bundle was before the gate); ``on`` (the
default of a new network) starts with the gate closed, so it sends nothing and its rows are the policy's own
prompt exactly (the span's room goes back to the text).

The untrained bundle copies the registered bundle's record (its held-out split, its reads, its budget and policy),
so the rows are the same boundaries as the registered memory's eval-memory. Rows: POLICY (the span's positions as
text), POLICY+empty (the text alone), POLICY+memory (the untrained span), POLICY+other (another trajectory's
untrained span). Prints the table and writes the command's JSON.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def untrained_bundle(ref: str, out: Path, seed: int = 0, span_gate: bool = True) -> Path:
    """A bundle of the network ``ref`` names as it is initialised, beside the actor ``ref`` was trained with."""
    import torch

    from palimpsest.models.actor import FrozenActor
    from palimpsest.models.memory import MemoryConfig
    from palimpsest.models.memory_network import MemoryNetwork
    from palimpsest.models.registry import BUNDLE_META, BUNDLE_WEIGHTS, read_bundle, resolve_actor_path

    bundle = read_bundle(ref)
    actor = FrozenActor.from_pretrained(resolve_actor_path(bundle.actor.get("path") or "smollm2"))
    torch.manual_seed(seed)
    net = MemoryNetwork(MemoryConfig(**{**bundle.memory, "span_gate": span_gate}), actor)
    out.mkdir(parents=True, exist_ok=True)
    torch.save(net.state_dict(), out / BUNDLE_WEIGHTS)
    meta = {**bundle.to_json(), "name": f"untrained ({bundle.name or ref})", "memory": net.cfg.to_dict()}
    (out / BUNDLE_META).write_text(json.dumps(meta, indent=2))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="auto", help="the registered memory whose config and split are used")
    ap.add_argument("--data", type=Path, default=ROOT.parent / "shared" / "data" / "trajectories" / "dev.jsonl")
    ap.add_argument("--window", type=int, default=8192)
    ap.add_argument("--max-boundaries", type=int, default=16)
    ap.add_argument("--span-gate", choices=("on", "off"), default="on", help="the untrained network with its span "
                    "gate (closed as it starts) or without one")
    ap.add_argument("--out", type=Path, default=None, help="default: benchmarks/results/memory_ladder/"
                    "untrained[_gated]_eval_memory_heldout.json")
    args = ap.parse_args()
    from palimpsest.models.registry import resolve_memory_ref

    if args.out is None:
        gated = "_gated" if args.span_gate == "on" else ""
        args.out = ROOT / "benchmarks" / "results" / "memory_ladder" / f"untrained{gated}_eval_memory_heldout.json"
    ref = resolve_memory_ref(args.model)
    if ref is None:
        raise SystemExit("no memory is registered: pass --model")
    bundle = untrained_bundle(ref, Path(tempfile.mkdtemp(prefix="untrained-")) / "bundle",
                              span_gate=args.span_gate == "on")
    cmd = [sys.executable, "-m", "palimpsest.cli", "eval-memory", "--model", str(bundle), "--data", str(args.data),
           "--window", str(args.window), "--max-boundaries", str(args.max_boundaries), "--json"]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if r.returncode != 0:
        raise SystemExit(f"eval-memory failed:\n{r.stderr[-3000:]}")
    doc = json.loads(r.stdout)
    doc["untrained_of"], doc["span_gate"] = ref, args.span_gate
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=2) + "\n")
    print(f"untrained network of {ref} (span gate {args.span_gate}), {args.data.name}, held out\n")
    print("| row | KL (95% CI) | top-1 | positions | boundaries | gap closed |")
    print("|---|---|---|---|---|---|")
    for label, p in doc["policies"].items():
        lo, hi = p["kl_ci"]
        g = doc["gap_closed"].get(label)
        print(f"| {label} | {p['kl']:.3f} ({lo:.3f}-{hi:.3f}) | {p['top1']:.3f} | {p['positions']:.0f} | "
              f"{p['boundaries']} | {'-' if g is None else f'{g:+.3f}'} |")


if __name__ == "__main__":
    main()
