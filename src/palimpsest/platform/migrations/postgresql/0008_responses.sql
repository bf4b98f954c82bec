-- Stored responses of the Responses API, equivalent to sqlite/0008_responses.sql (append-only).
CREATE TABLE IF NOT EXISTS responses (
    id TEXT PRIMARY KEY, session_id TEXT NOT NULL REFERENCES sessions(id), parent TEXT,
    body TEXT NOT NULL, created DOUBLE PRECISION NOT NULL);
CREATE TRIGGER responses_append_only BEFORE UPDATE OR DELETE ON responses
    FOR EACH ROW EXECUTE FUNCTION palimpsest_append_only();
CREATE TRIGGER responses_no_truncate BEFORE TRUNCATE ON responses
    FOR EACH STATEMENT EXECUTE FUNCTION palimpsest_append_only();
