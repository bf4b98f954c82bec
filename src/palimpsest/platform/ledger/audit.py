"""The audit: every compiled turn's plan (each step's resolution, reason and score), and the glimpses a turn
used. Written in the turn's transaction; read back whole by ``palimpsest audit`` and the API."""

from __future__ import annotations

import json
import time
import zlib

import numpy as np

from palimpsest.platform.ledger.store import _log
from palimpsest.platform.types import CompiledTurn, Resolution

_LABELS = [r.label for r in sorted(Resolution, key=int)]


class Audit:
    """The ledger's audit (mixed into :class:`palimpsest.platform.ledger.Ledger`)."""

    def record_turn(self, turn: CompiledTurn) -> None:
        p = turn.plan
        # Format 2: t is 0..n-1; step ids, resolutions, reasons and scores as compact columns (a turn over
        # 100,000 steps writes ~1.5 MB before compression, not 4 MB).
        blob = zlib.compress(p.step_id.astype(np.int64).tobytes() + p.resolution.astype(np.int8).tobytes()
                             + p.reason_code.astype(np.int16).tobytes() + p.score.astype(np.float32).tobytes(), 1)
        head = {"n": len(p), "format": 2, "reasons": p.reasons, "reserve": turn.prompt.reserve}
        if p.info.get("elided"):
            head["elided"] = p.info["elided"]  # oversized steps shown head and tail
        if p.info.get("folded"):
            head["folded"] = p.info["folded"]  # old history folded into range lines
        # a compaction boundary (what changed, why), the epoch extended, what scored the old steps (a relevance
        # predictor's reference, or "cosine")
        for k in ("compaction", "epoch", "relevance"):
            if p.info.get(k):
                head[k] = p.info[k]
        plan_blob = json.dumps(head).encode() + b"\0" + blob
        with self._tx() as db:
            _log(db, turn.session_id, self._bump(db, turn.session_id), [("turn", None, p.policy, turn.prompt.tokens)])
            db.execute(
                "INSERT INTO audit (session_id, t, policy, config_hash, budget, prompt_hash, prefix_hash, tokens,"
                " prefix_tokens, counts, plan, degradations, created) VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?)",
                (turn.session_id, turn.t, p.policy, p.config_hash, turn.budget, turn.prompt.prompt_hash,
                 turn.prompt.prefix_hash, turn.prompt.tokens, turn.prompt.prefix_tokens, json.dumps(p.counts()),
                 plan_blob, json.dumps([[t, _LABELS[b], _LABELS[a]] for t, b, a in p.degraded.tolist()]), time.time()),
            )

    def turns_recorded(self, session_id: str, config_hash: str, budget: int) -> int:
        """How many turns of a session are audited under one policy config and budget."""
        row = self._read_one("SELECT COUNT(*) FROM audit WHERE session_id=? AND config_hash=? AND budget=?",
                             (session_id, config_hash, int(budget)))
        return int(row[0]) if row else 0

    def audit(self, session_id: str) -> list[dict]:
        """Every recorded turn of a session, oldest first, with its full plan decoded."""
        self.session(session_id)
        rows = self._read(
            "SELECT t, policy, config_hash, budget, prompt_hash, prefix_hash, tokens, prefix_tokens, counts, plan,"
            " degradations, created FROM audit WHERE session_id=? ORDER BY id", (session_id,))
        out = []
        for r in rows:
            head, blob = bytes(r[9]).split(b"\0", 1)
            meta = json.loads(head)
            n = meta["n"]
            raw = zlib.decompress(blob)
            if meta.get("format", 1) == 2:
                ids = np.frombuffer(raw[: 8 * n], dtype=np.int64)
                res = np.frombuffer(raw[8 * n: 9 * n], dtype=np.int8)
                why = np.frombuffer(raw[9 * n: 11 * n], dtype=np.int16)
                scores = np.frombuffer(raw[11 * n:], dtype=np.float32)
                cols = (np.arange(n), ids, res, why)
            else:  # format 1: four int64 rows (t, step id, resolution, reason), then float64 scores
                cols = tuple(np.frombuffer(raw[: 4 * n * 8], dtype=np.int64).reshape(4, n))
                scores = np.frombuffer(raw[4 * n * 8:], dtype=np.float64)
            plan = [{"t": t, "step_id": sid, "resolution": _LABELS[lv], "reason": meta["reasons"][rc], "score": sc}
                    for t, sid, lv, rc, sc in zip(*(c.tolist() for c in cols), scores.tolist())]
            out.append({"t": r[0], "policy": r[1], "config_hash": r[2], "budget": r[3], "prompt_hash": r[4],
                        "prefix_hash": r[5], "tokens": r[6], "prefix_tokens": r[7], "counts": json.loads(r[8]),
                        "plan": plan, "degradations": json.loads(r[10]), "created": r[11],
                        "reserve": meta.get("reserve", 0), "elided": meta.get("elided", []),
                        "folded": meta.get("folded"), "compaction": meta.get("compaction"),
                        "epoch": meta.get("epoch"), "relevance": meta.get("relevance")})
        return out

    def record_glimpse(self, session_id: str, step_id: int, limit: int) -> bool:
        """Count a glimpse against the current turn (t = steps so far); False once ``limit`` are used."""
        with self._tx() as db:
            self._store.lock_session(db, session_id)  # count-then-insert must not race another replica
            (t,) = db.execute("SELECT COUNT(*) FROM steps WHERE session_id=?", (session_id,)).fetchone()
            (used,) = db.execute("SELECT COUNT(*) FROM glimpses WHERE session_id=? AND t=?", (session_id, t)).fetchone()
            if used >= limit:
                return False
            db.execute("INSERT INTO glimpses (session_id, t, step_id, created) VALUES (?,?,?,?)",
                       (session_id, t, step_id, time.time()))
            return True
