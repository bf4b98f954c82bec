"""Experiments: what each served turn cost under its arm, the sessions' outcomes, and the shadow lane's fidelity
records: what ``palimpsest ab`` and the A/B report read."""

from __future__ import annotations

import json
import time
from typing import Mapping

from palimpsest.platform.types import LedgerError

#: the kinds of shadow reference, never pooled (:func:`reference_kind`)
REFERENCE_KINDS = ("full", "policy@window")


def reference_kind(reference: str) -> str:
    """The kind of a shadow record's ``reference``: ``full`` (the whole history) or ``policy@window`` (the arm's
    policy where the whole history does not fit). The two measure different things and are reported apart."""
    return "full" if reference == "full" else "policy@window"


class Experiments:
    """The ledger's A/B record (mixed into :class:`palimpsest.platform.ledger.Ledger`)."""

    def record_served(self, session_id: str, t: int, arm: str, metrics: Mapping[str, float | int]) -> None:
        """What a served turn cost (tokens, latency per stage, glimpses, error) under its arm."""
        with self._tx() as db:
            db.execute("INSERT INTO served (session_id, t, arm, metrics, created) VALUES (?,?,?,?,?)",
                       (session_id, int(t), arm, json.dumps(dict(metrics)), time.time()))

    def record_outcome(self, session_id: str, arm: str, value: float, note: str = "") -> None:
        if not isinstance(value, (int, float)) or isinstance(value, bool) or value != value:
            raise LedgerError(f"an outcome must be a finite number, got {value!r}")
        self.session(session_id)
        with self._tx() as db:
            db.execute("INSERT INTO outcomes (session_id, arm, value, note, created) VALUES (?,?,?,?,?)",
                       (session_id, arm, float(value), note, time.time()))

    def served(self, since: float = 0.0, kind: str | None = "turn") -> list[dict]:
        """Every served turn since ``since`` (unix time), oldest first; ``kind="summary"``: the actor calls of LLM
        summaries recorded under a session's arm instead; None: both."""
        rows = [{"session_id": r[0], "t": r[1], "arm": r[2], **json.loads(r[3]), "created": r[4]}
                for r in self._read("SELECT session_id, t, arm, metrics, created FROM served WHERE created>=?"
                                    " ORDER BY id", (since,))]
        return rows if kind is None else [r for r in rows if r.get("kind", "turn") == kind]

    def record_shadow(self, session_id: str, t: int, arm: str, status: str, reason: str = "", reference: str = "",
                      kl: float | None = None, top1: float | None = None, tokens: int = 0) -> None:
        """A sampled served turn's shadow fidelity (``scored``), that it served its reference itself (``identical``:
        nothing to measure), or why it has none (``skipped``)."""
        if status not in ("scored", "identical", "skipped"):
            raise LedgerError(f"shadow status must be 'scored', 'identical' or 'skipped', got {status!r}")
        with self._tx() as db:
            db.execute("INSERT INTO shadow (session_id, t, arm, status, reason, reference, kl, top1, tokens, created)"
                       " VALUES (?,?,?,?,?,?,?,?,?,?)",
                       (session_id, int(t), arm, status, reason, reference, kl, top1, int(tokens), time.time()))

    def shadows(self, since: float = 0.0) -> list[dict]:
        """Every shadow-fidelity record since ``since`` (unix time), oldest first."""
        cols = ("session_id", "t", "arm", "status", "reason", "reference", "kl", "top1", "tokens", "created")
        return [dict(zip(cols, r)) for r in self._read(
            f"SELECT {', '.join(cols)} FROM shadow WHERE created>=? ORDER BY id", (since,))]

    def outcomes(self, since: float = 0.0) -> list[dict]:
        return [{"session_id": r[0], "arm": r[1], "value": r[2], "note": r[3], "created": r[4]}
                for r in self._read("SELECT session_id, arm, value, note, created FROM outcomes WHERE created>=?"
                                    " ORDER BY id", (since,))]

    def record_shadow_pair(self, session_id: str, t: int, control: str, candidate: str, subject: str, status: str,
                           reason: str = "", reference: str = "", control_kl: float | None = None,
                           control_top1: float | None = None, candidate_kl: float | None = None,
                           candidate_top1: float | None = None, control_tokens: int = 0, candidate_tokens: int = 0,
                           tokens: int = 0) -> None:
        """A candidate arm judged on a live turn of its control: both prompts of that same turn (``session_id``,
        ``t``) scored against the same reference over the same reply (``scored``), or why not (``skipped``).
        ``*_tokens``: each prompt's positions (ids and soft). The candidate served nothing: no ``served`` row."""
        if status not in ("scored", "skipped"):
            raise LedgerError(f"shadow pair status must be 'scored' or 'skipped', got {status!r}")
        with self._tx() as db:
            db.execute("INSERT INTO shadow_pairs (session_id, t, control, candidate, subject, status, reason, "
                       "reference, control_kl, control_top1, candidate_kl, candidate_top1, control_tokens, "
                       "candidate_tokens, tokens, created) VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
                       (session_id, int(t), control, candidate, subject, status, reason, reference, control_kl,
                        control_top1, candidate_kl, candidate_top1, int(control_tokens), int(candidate_tokens),
                        int(tokens), time.time()))

    def shadow_pairs(self, candidate: str | None = None, subject: str | None = None, after: int = 0) -> list[dict]:
        """The paired shadow records (of ``candidate`` judged as ``subject``) with an id above ``after``, oldest
        first."""
        cols = ("id", "session_id", "t", "control", "candidate", "subject", "status", "reason", "reference",
                "control_kl", "control_top1", "candidate_kl", "candidate_top1", "control_tokens", "candidate_tokens",
                "tokens", "created")
        where, params = ["id>?"], [int(after)]
        for name, value in (("candidate", candidate), ("subject", subject)):
            if value is not None:
                where.append(f"{name}=?")
                params.append(value)
        return [dict(zip(cols, r)) for r in self._read(
            f"SELECT {', '.join(cols)} FROM shadow_pairs WHERE {' AND '.join(where)} ORDER BY id", params)]
