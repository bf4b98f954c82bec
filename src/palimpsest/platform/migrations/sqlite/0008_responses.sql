-- Stored responses of the Responses API (serving/responses_proxy.py): what a later request's
-- `previous_response_id` resolves to. A row holds its own request's messages and its output (chat form,
-- JSON) and the response it continued (`parent`), so a conversation resolves by walking the chain. The
-- session is the ledger's (a tenant sees only its own). Append-only, like every table.
CREATE TABLE IF NOT EXISTS responses (
    id TEXT PRIMARY KEY, session_id TEXT NOT NULL REFERENCES sessions(id), parent TEXT,
    body TEXT NOT NULL, created REAL NOT NULL);
CREATE TRIGGER IF NOT EXISTS responses_no_update BEFORE UPDATE ON responses
BEGIN SELECT RAISE(ABORT, 'responses is append-only'); END;
CREATE TRIGGER IF NOT EXISTS responses_no_delete BEFORE DELETE ON responses
BEGIN SELECT RAISE(ABORT, 'responses is append-only'); END;
