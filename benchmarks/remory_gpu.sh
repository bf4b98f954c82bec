#!/usr/bin/env bash
# The REMORY ladder and its held-out figure on one GPU, in one command (about 10 minutes on an H200):
#
#     benchmarks/remory_gpu.sh [OUT_DIR]        # default benchmarks/results/gpu
#
# 1. rung 1: one boundary, train = eval (target: 90% of pace's KL gap closed);
# 2. rung 2: 64 recall-session boundaries at budget 1,536, train = eval (target: 60%);
# 3. `palimpsest train --config configs/train/remory_one_gpu.yaml` (Ray Train + DeepSpeed on the GPU, registered
#    in MLflow), then rung 3: `palimpsest eval-actions --policy pace,pace+empty,pace+memory` on the dev
#    trajectories the memory never saw, at its budget.
# Each figure's JSON records the device; `gpu.txt` names the GPU. Needs the environment `make install` builds
# (the actor converted offline) and ../shared's dev trajectories.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-benchmarks/results/gpu}
CFG=configs/train/remory_one_gpu.yaml
DEV=../shared/data/trajectories/dev.jsonl
mkdir -p "$OUT"
make install >/dev/null
PY=.venv/bin/python
$PY -c "import torch; assert torch.cuda.is_available(), 'no GPU: this script is for a machine with one'; print(torch.cuda.get_device_name(0))" | tee "$OUT/gpu.txt"
export PYTHONPATH=. PYTHONUNBUFFERED=1
start=$(date +%s)
$PY benchmarks/remory_ladder.py --rung 1 --config $CFG --device cuda --steps 300 --lr 3e-3 --schedule cosine \
    --kl-decay 0 --eval-every 50 --out "$OUT/ladder_rung1.json" | tee "$OUT/ladder_rung1.log"
$PY benchmarks/remory_ladder.py --rung 2 --config $CFG --device cuda --budget 1536 --recall-sessions 100 \
    --boundaries 64 --steps 640 --lr 3e-3 --schedule cosine --kl-decay 0 --eval-every 160 \
    --out "$OUT/ladder_rung2.json" | tee "$OUT/ladder_rung2.log"
.venv/bin/palimpsest train --config $CFG 2>&1 | tee "$OUT/train.log"   # registers the newest version
.venv/bin/palimpsest eval-actions --data $DEV --policy pace,pace+empty,pace+memory \
    --memory models:/palimpsest-memory/latest \
    --policy-config configs/replay/reference.yaml --budget 3072 --window 8192 --reference pace --json \
    > "$OUT/rung3.json"
$PY - "$OUT" "$start" <<'PY'
import json, sys, time
out, start = sys.argv[1], float(sys.argv[2])
gpu = open(f"{out}/gpu.txt").read().strip()
print(f"on {gpu}, {time.time() - start:.0f} s in all")
for rung in (1, 2):
    d = json.load(open(f"{out}/ladder_rung{rung}.json"))
    print(f"rung {rung}: gap closed {d['gap_closed']:.3f} (target {d['target']:.2f})")
d = json.load(open(f"{out}/rung3.json"))
for label, p in d["policies"].items():
    g = d["gap_closed"].get(label)
    print(f"rung 3 {label}: KL {p['kl']:.4f} over {p['boundaries']} held-out boundaries, gap closed "
          f"{'-' if g is None else f'{g:+.3f}'}")
PY
