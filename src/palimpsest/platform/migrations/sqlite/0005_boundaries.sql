-- Compaction epochs (platform/epochs.py): each compaction boundary of a session under a policy config and
-- budget (`key`), with the exact messages it built, so every replica rebuilds the append-only turns that
-- follow it byte for byte. The latest row of a (session, key) at or before a step is the boundary in effect.
CREATE TABLE IF NOT EXISTS boundaries (
    id INTEGER PRIMARY KEY AUTOINCREMENT, session_id TEXT NOT NULL REFERENCES sessions(id), key TEXT NOT NULL,
    t INTEGER NOT NULL, digest TEXT NOT NULL, body BLOB NOT NULL, created REAL NOT NULL);
CREATE INDEX IF NOT EXISTS boundaries_session ON boundaries (session_id, key, t, id);
CREATE TRIGGER IF NOT EXISTS boundaries_no_update BEFORE UPDATE ON boundaries
BEGIN SELECT RAISE(ABORT, 'boundaries is append-only'); END;
CREATE TRIGGER IF NOT EXISTS boundaries_no_delete BEFORE DELETE ON boundaries
BEGIN SELECT RAISE(ABORT, 'boundaries is append-only'); END;
