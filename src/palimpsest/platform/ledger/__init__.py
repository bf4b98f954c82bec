"""The step ledger: an append-only store of every step, its representations, keys and audits.

The backend is chosen by URL (:mod:`palimpsest.platform.ledger.backends`): SQLite in WAL mode with
``synchronous=FULL`` is the embedded default, PostgreSQL (``postgresql://...``) serves several
replicas and machines. Either way a step is committed before :meth:`Ledger.append` returns, and
triggers make every table append-only, so raw text can never be updated or deleted by any code
path, this package's included. The schema lives in ``platform/migrations/``.

Reads go through :meth:`Ledger.snapshot`, one read transaction that returns an immutable
:class:`SessionSnapshot` (columns as numpy arrays), the only input a policy ever sees. Every
read and every write names its session; a step id of another session is "unknown" here.

One module per concern, one class over them:

- ``store``: sessions, steps, summaries, keys, folds;
- ``boundaries``: compaction boundaries, work leases;
- ``audit``: each compiled turn's plan, and the glimpses a turn used;
- ``experiments``: served turns, outcomes, shadow fidelity and candidates' paired shadow records (the A/B record);
- ``rollouts``: each decision on a candidate arm's stage, with its evidence;
- ``responses``: the Responses API's stored responses (what ``previous_response_id`` resolves to);
- ``snapshot``: the snapshot a policy plans on, and the delta a cached snapshot catches up with.

The ledger does not know the prompt: what a session's fixed prefix costs is handed to it
(``prefix_cost``; :class:`palimpsest.platform.runtime.Runtime` hands it the prompt's own).
"""

from __future__ import annotations

from palimpsest.platform.ledger.audit import Audit
from palimpsest.platform.ledger.boundaries import Boundaries
from palimpsest.platform.ledger.experiments import Experiments
from palimpsest.platform.ledger.responses import Responses
from palimpsest.platform.ledger.rollouts import Rollouts
from palimpsest.platform.ledger.snapshot import SalientIndex, SessionSnapshot, SnapshotDelta, SnapshotReads
from palimpsest.platform.ledger.store import PrefixCost, Store


class Ledger(Store, Boundaries, Audit, Experiments, Rollouts, Responses, SnapshotReads):
    """Append-only step ledger. Thread-safe; several processes (SQLite) or machines (PostgreSQL) may
    share one.

    ``url``: a file path or ``sqlite:///path`` (the default backend), ``:memory:``, or
    ``postgresql://user:password@host:port/db`` (``?options=-csearch_path%3Dname`` picks a schema).
    An unreachable database raises :class:`LedgerUnavailableError` naming it (password hidden).
    ``prefix_cost``: what a session's fixed prefix costs in the actor's ids (a Runtime over this ledger
    hands it the prompt's own when none is given).
    """


__all__ = ["Ledger", "PrefixCost", "SalientIndex", "SessionSnapshot", "SnapshotDelta"]
