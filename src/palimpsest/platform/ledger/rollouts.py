"""Rollout decisions: each stage a candidate arm moves to (dark, canary, promoted, withdrawn) with its evidence,
appended in one line per candidate and subject, so every replica's router reads the same stage and a restart
keeps it (mixed into :class:`palimpsest.platform.ledger.Ledger`)."""

from __future__ import annotations

import json
import time
from typing import Any, Mapping

from palimpsest.platform.types import LedgerError

#: a candidate's stages: never served (dark), served to a share of its control's sessions (canary), serving all of
#: them (promoted), serving none (withdrawn)
STAGES = ("dark", "canary", "promoted", "withdrawn")
_COLS = ("id", "candidate", "control", "subject", "prev", "stage", "decision", "evidence", "created")


class Rollouts:
    """The ledger's rollout decisions (append-only; a decision on a stale view is refused)."""

    def record_rollout(self, candidate: str, control: str, subject: str, stage: str, decision: str,
                       evidence: Mapping[str, Any], prev: int) -> int | None:
        """Append a decision that puts ``candidate`` (judged as ``subject``) at ``stage``; ``prev``: the id of the
        latest decision the caller saw (0: none). Returns the new row's id, or None when another decision came
        first (the caller's view was stale; nothing is written)."""
        if stage not in STAGES:
            raise LedgerError(f"a rollout stage is one of {list(STAGES)}, got {stage!r}")
        body = json.dumps(dict(evidence), sort_keys=True, default=float)
        try:
            with self._tx() as db:
                latest = db.execute("SELECT MAX(id) FROM rollouts WHERE candidate=? AND subject=?",
                                    (candidate, subject)).fetchone()[0]
                if int(latest or 0) != int(prev):
                    return None
                (row,) = db.execute(
                    "INSERT INTO rollouts (candidate, control, subject, prev, stage, decision, evidence, created)"
                    " VALUES (?,?,?,?,?,?,?,?) RETURNING id",
                    (candidate, control, subject, int(prev), stage, decision, body, time.time())).fetchone()
        except Exception as e:  # PostgreSQL: a concurrent decider passed the check first (the table's trigger)
            if "follow the latest" in str(e):
                return None
            raise
        return int(row)

    def rollouts(self, candidate: str | None = None) -> list[dict]:
        """Every decision (of ``candidate``), oldest first, its evidence decoded."""
        where, params = ("WHERE candidate=?", (candidate,)) if candidate is not None else ("", ())
        rows = self._read(f"SELECT {', '.join(_COLS)} FROM rollouts {where} ORDER BY id", params)
        return [{**dict(zip(_COLS, r)), "evidence": json.loads(r[7])} for r in rows]

    def rollout_latest(self) -> dict[tuple[str, str], dict]:
        """The latest decision per (candidate, subject): the stage in force."""
        latest: dict[tuple[str, str], dict] = {}
        for r in self.rollouts():
            latest[(r["candidate"], r["subject"])] = r
        return latest
