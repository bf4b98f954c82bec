"""Stored responses of the Responses API: each response's own messages and output, and the response it
continued, so that a request naming ``previous_response_id`` resolves to the whole conversation before it."""

from __future__ import annotations

import json
import time

from palimpsest.platform.types import LedgerError, UnknownSessionError

#: The longest chain of ``previous_response_id`` resolved (a loop is impossible: a row names an older one)
MAX_CHAIN = 100_000


class Responses:
    """The ledger's stored responses (mixed into :class:`palimpsest.platform.ledger.Ledger`)."""

    def record_response(self, response_id: str, session_id: str, parent: str | None, body: dict) -> None:
        """One response: ``body`` holds its request's messages (``messages``), its output (``output``) and its
        instructions; ``parent`` the response it continued."""
        with self._tx() as db:
            db.execute("INSERT INTO responses (id, session_id, parent, body, created) VALUES (?,?,?,?,?)",
                       (response_id, session_id, parent, json.dumps(body, ensure_ascii=False), time.time()))

    def response(self, response_id: str) -> dict:
        """A stored response: ``{"id", "session_id", "parent", **body}``; unknown ids raise UnknownSessionError."""
        row = self._read_one("SELECT id, session_id, parent, body FROM responses WHERE id=?", (response_id,))
        if row is None:
            raise UnknownSessionError(f"previous_response_id: no stored response {response_id!r}")
        return {"id": row[0], "session_id": row[1], "parent": row[2], **json.loads(row[3])}

    def response_chain(self, response_id: str) -> list[dict]:
        """The stored responses from the conversation's first to ``response_id``, oldest first."""
        chain, at = [], response_id
        while at is not None:
            if len(chain) >= MAX_CHAIN:
                raise LedgerError(f"previous_response_id: the chain behind {response_id!r} is longer than {MAX_CHAIN}")
            r = self.response(at)
            chain.append(r)
            at = r["parent"]
        return chain[::-1]
