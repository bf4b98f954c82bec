-- Incremental snapshots. `session_versions` counts the writes to each session (steps, summaries, keys,
-- folds, audited turns): every such transaction bumps it, so a replica that cached a session's snapshot
-- checks one row to know whether it is current. It is a counter, the one mutable row per session.
-- `changes` says what each version added, so a cached snapshot reads only that (append-only).
CREATE TABLE IF NOT EXISTS session_versions (
    session_id TEXT PRIMARY KEY REFERENCES sessions(id), version INTEGER NOT NULL);
INSERT OR IGNORE INTO session_versions (session_id, version) SELECT id, 0 FROM sessions;
CREATE TABLE IF NOT EXISTS changes (
    session_id TEXT NOT NULL REFERENCES sessions(id), version INTEGER NOT NULL, kind TEXT NOT NULL,
    step_id INTEGER, policy TEXT, tokens INTEGER);
CREATE INDEX IF NOT EXISTS changes_session ON changes (session_id, version);
CREATE TRIGGER IF NOT EXISTS changes_no_update BEFORE UPDATE ON changes
BEGIN SELECT RAISE(ABORT, 'changes is append-only'); END;
CREATE TRIGGER IF NOT EXISTS changes_no_delete BEFORE DELETE ON changes
BEGIN SELECT RAISE(ABORT, 'changes is append-only'); END;
-- Shadow fidelity of live A/B: per sampled served turn, the action-fidelity measure of its prompt against the
-- full-history reference (scored), or why it was not scored (skipped under load, stale, unsupported).
CREATE TABLE IF NOT EXISTS shadow (
    id INTEGER PRIMARY KEY AUTOINCREMENT, session_id TEXT NOT NULL REFERENCES sessions(id), t INTEGER NOT NULL,
    arm TEXT NOT NULL, status TEXT NOT NULL, reason TEXT NOT NULL, reference TEXT NOT NULL, kl REAL, top1 REAL,
    tokens INTEGER NOT NULL, created REAL NOT NULL);
CREATE INDEX IF NOT EXISTS shadow_created ON shadow (created);
CREATE TRIGGER IF NOT EXISTS shadow_no_update BEFORE UPDATE ON shadow
BEGIN SELECT RAISE(ABORT, 'shadow is append-only'); END;
CREATE TRIGGER IF NOT EXISTS shadow_no_delete BEFORE DELETE ON shadow
BEGIN SELECT RAISE(ABORT, 'shadow is append-only'); END;
