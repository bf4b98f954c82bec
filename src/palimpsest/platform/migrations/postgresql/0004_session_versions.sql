-- Incremental snapshots, equivalent to sqlite/0004_session_versions.sql. Every write to a session bumps
-- its row in `session_versions` first (the row lock orders the session's writers, so versions commit in
-- order); `changes` says what each version added (append-only).
CREATE TABLE IF NOT EXISTS session_versions (
    session_id TEXT PRIMARY KEY REFERENCES sessions(id), version BIGINT NOT NULL);
INSERT INTO session_versions (session_id, version) SELECT id, 0 FROM sessions ON CONFLICT DO NOTHING;
CREATE TABLE IF NOT EXISTS changes (
    session_id TEXT NOT NULL REFERENCES sessions(id), version BIGINT NOT NULL, kind TEXT NOT NULL,
    step_id BIGINT, policy TEXT, tokens BIGINT);
CREATE INDEX IF NOT EXISTS changes_session ON changes (session_id, version);
CREATE TRIGGER changes_append_only BEFORE UPDATE OR DELETE ON changes
    FOR EACH ROW EXECUTE FUNCTION palimpsest_append_only();
CREATE TRIGGER changes_no_truncate BEFORE TRUNCATE ON changes
    FOR EACH STATEMENT EXECUTE FUNCTION palimpsest_append_only();
