"""How many Stage II rows a training config's data makes, and what their teacher costs: the rows per file and split
(``data.file`` and ``data.extra_files``), with the teacher's ids per row (the whole history the teacher prefills at
every distillation step, or once when cached).

    .venv/bin/python benchmarks/stage2_rows.py [--config configs/train/remory_small.yaml] \
        [--set data.max_history_tokens=4096 ...] [--out FILE]

The rows are built by the data builder the launcher calls (``training.prepare.data_config`` ->
``training.remory_data.build_datasets``, the serving code's compile), into a scratch directory; no teacher is
computed. ``--set`` overrides a ``data.`` field (repeatable), so settings can be compared side by side.
Results: ``benchmarks/results/stage2_rows/<config>[_<overrides>].json``.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", type=Path, default=ROOT / "configs" / "train" / "remory_small.yaml")
    ap.add_argument("--set", action="append", default=[], metavar="data.FIELD=VALUE")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    import pyarrow.parquet as pq

    from palimpsest.platform.policies import load_policy_file
    from palimpsest.training.prepare import data_config, resolve_actor
    from palimpsest.training.remory_data import build_datasets
    from palimpsest.training.train_config import parse_train_config

    raw = yaml.safe_load(args.config.read_text())
    for kv in args.set:
        key, _, value = kv.partition("=")
        if not key.startswith("data.") or not value:
            raise SystemExit(f"--set {kv!r}: expected data.FIELD=VALUE")
        raw["data"][key[5:]] = yaml.safe_load(value)
    cfg = parse_train_config(raw, where=str(args.config))
    files = [Path(f) for f in (cfg.data.file, *cfg.data.extra_files)]
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="stage2-rows-") as tmp:
        report = build_datasets(files, str(resolve_actor(cfg)), Path(tmp), data_config(cfg),
                                load_policy_file(cfg.tracking.policy_config))
        rows = pq.read_table(Path(tmp) / "stage2.parquet").to_pylist()
    seconds = round(time.perf_counter() - t0, 1)
    ids = {}
    for f in files:
        ids[str(f)] = {json.loads(line)["id"] for line in f.read_text().splitlines() if line.strip()}
    recall = {r["trajectory"] for r in rows if r["trajectory"].startswith("recall/")}  # data.recall_sessions
    if recall:
        ids["recall sessions"] = recall
    table, counted = {}, 0
    for name, members in ids.items():
        for split in ("train", "val"):
            mine = [r for r in rows if r["trajectory"] in members and r["split"] == split]
            counted += len(mine)
            hist = [r["history_len"] for r in mine]
            table[f"{name} {split}"] = {
                "rows": len(mine), "trajectories": len({r["trajectory"] for r in mine}),
                "teacher_ids_median": statistics.median(hist) if hist else None,
                "teacher_ids_total": sum(hist)}
    if counted != len(rows):
        raise SystemExit(f"{len(rows) - counted} of {len(rows)} rows fell in no file's bucket")
    doc = {"config": str(args.config.relative_to(ROOT) if args.config.is_absolute() else args.config),
           "overrides": args.set, "data": data_config(cfg).to_dict(), "build_seconds": seconds, "rows": table,
           "skipped": len(report["skipped"])}
    tag = "".join("_" + re.sub(r"[^A-Za-z0-9]+", "_", Path(s.split(".", 1)[1]).name).strip("_") for s in args.set)
    out = args.out or (ROOT / "benchmarks" / "results" / "stage2_rows" / f"{args.config.stem}{tag}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=2) + "\n")
    print(f"{doc['config']} {' '.join(args.set)}: built in {seconds} s")
    print(f"{'file split':60} {'rows':>5} {'trajs':>5} {'teacher ids (median)':>21} {'teacher ids (total)':>20}")
    for k, v in table.items():
        print(f"{k:60} {v['rows']:>5} {v['trajectories']:>5} {str(v['teacher_ids_median']):>21} "
              f"{v['teacher_ids_total']:>20}")


if __name__ == "__main__":
    main()
