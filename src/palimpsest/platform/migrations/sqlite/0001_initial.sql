-- The ledger as first released: raw steps, their representations, keys, folds and the audit,
-- every table but meta append-only (triggers refuse UPDATE and DELETE).
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS sessions (
    id TEXT PRIMARY KEY, task TEXT NOT NULL, system TEXT NOT NULL, tools TEXT,
    meta TEXT NOT NULL, created REAL NOT NULL);
CREATE TABLE IF NOT EXISTS steps (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    session_id TEXT NOT NULL REFERENCES sessions(id),
    t INTEGER NOT NULL, kind TEXT NOT NULL, thought TEXT NOT NULL, action TEXT NOT NULL,
    observation TEXT, authority TEXT NOT NULL, tool TEXT, sha256 TEXT NOT NULL,
    tok_thought INTEGER NOT NULL, tok_action INTEGER NOT NULL, tok_observation INTEGER NOT NULL,
    tok_full INTEGER NOT NULL, created REAL NOT NULL,
    UNIQUE (session_id, t));
CREATE TABLE IF NOT EXISTS representations (
    step_id INTEGER NOT NULL REFERENCES steps(id), resolution TEXT NOT NULL, text TEXT NOT NULL,
    tokens INTEGER NOT NULL, producer TEXT NOT NULL, producer_version TEXT NOT NULL, created REAL NOT NULL,
    PRIMARY KEY (step_id, resolution, producer, producer_version));
CREATE TABLE IF NOT EXISTS abstractions (
    step_id INTEGER NOT NULL REFERENCES steps(id), producer TEXT NOT NULL, producer_version TEXT NOT NULL,
    body TEXT NOT NULL, created REAL NOT NULL, PRIMARY KEY (step_id, producer, producer_version));
CREATE TABLE IF NOT EXISTS keys (
    step_id INTEGER NOT NULL REFERENCES steps(id), model TEXT NOT NULL, dim INTEGER NOT NULL,
    vector BLOB NOT NULL, created REAL NOT NULL, PRIMARY KEY (step_id, model));
CREATE TABLE IF NOT EXISTS folds (
    session_id TEXT NOT NULL REFERENCES sessions(id), policy_key TEXT NOT NULL, upto INTEGER NOT NULL,
    text TEXT NOT NULL, tokens INTEGER NOT NULL, producer TEXT NOT NULL, created REAL NOT NULL,
    PRIMARY KEY (session_id, policy_key, upto));
CREATE TABLE IF NOT EXISTS audit (
    id INTEGER PRIMARY KEY AUTOINCREMENT, session_id TEXT NOT NULL REFERENCES sessions(id),
    t INTEGER NOT NULL, policy TEXT NOT NULL, config_hash TEXT NOT NULL, budget INTEGER NOT NULL,
    prompt_hash TEXT NOT NULL, prefix_hash TEXT NOT NULL, tokens INTEGER NOT NULL, prefix_tokens INTEGER NOT NULL,
    counts TEXT NOT NULL, plan BLOB NOT NULL, degradations TEXT NOT NULL, created REAL NOT NULL);
CREATE INDEX IF NOT EXISTS audit_session ON audit (session_id, t);
CREATE TABLE IF NOT EXISTS glimpses (
    id INTEGER PRIMARY KEY AUTOINCREMENT, session_id TEXT NOT NULL, t INTEGER NOT NULL,
    step_id INTEGER NOT NULL, created REAL NOT NULL);
CREATE TABLE IF NOT EXISTS served (
    id INTEGER PRIMARY KEY AUTOINCREMENT, session_id TEXT NOT NULL REFERENCES sessions(id), t INTEGER NOT NULL,
    arm TEXT NOT NULL, metrics TEXT NOT NULL, created REAL NOT NULL);
CREATE INDEX IF NOT EXISTS served_arm ON served (arm);
CREATE TABLE IF NOT EXISTS outcomes (
    id INTEGER PRIMARY KEY AUTOINCREMENT, session_id TEXT NOT NULL REFERENCES sessions(id), arm TEXT NOT NULL,
    value REAL NOT NULL, note TEXT NOT NULL, created REAL NOT NULL);
CREATE TRIGGER IF NOT EXISTS sessions_no_update BEFORE UPDATE ON sessions
BEGIN SELECT RAISE(ABORT, 'sessions is append-only'); END;
CREATE TRIGGER IF NOT EXISTS sessions_no_delete BEFORE DELETE ON sessions
BEGIN SELECT RAISE(ABORT, 'sessions is append-only'); END;
CREATE TRIGGER IF NOT EXISTS steps_no_update BEFORE UPDATE ON steps
BEGIN SELECT RAISE(ABORT, 'steps is append-only'); END;
CREATE TRIGGER IF NOT EXISTS steps_no_delete BEFORE DELETE ON steps
BEGIN SELECT RAISE(ABORT, 'steps is append-only'); END;
CREATE TRIGGER IF NOT EXISTS representations_no_update BEFORE UPDATE ON representations
BEGIN SELECT RAISE(ABORT, 'representations is append-only'); END;
CREATE TRIGGER IF NOT EXISTS representations_no_delete BEFORE DELETE ON representations
BEGIN SELECT RAISE(ABORT, 'representations is append-only'); END;
CREATE TRIGGER IF NOT EXISTS abstractions_no_update BEFORE UPDATE ON abstractions
BEGIN SELECT RAISE(ABORT, 'abstractions is append-only'); END;
CREATE TRIGGER IF NOT EXISTS abstractions_no_delete BEFORE DELETE ON abstractions
BEGIN SELECT RAISE(ABORT, 'abstractions is append-only'); END;
CREATE TRIGGER IF NOT EXISTS keys_no_update BEFORE UPDATE ON keys
BEGIN SELECT RAISE(ABORT, 'keys is append-only'); END;
CREATE TRIGGER IF NOT EXISTS keys_no_delete BEFORE DELETE ON keys
BEGIN SELECT RAISE(ABORT, 'keys is append-only'); END;
CREATE TRIGGER IF NOT EXISTS folds_no_update BEFORE UPDATE ON folds
BEGIN SELECT RAISE(ABORT, 'folds is append-only'); END;
CREATE TRIGGER IF NOT EXISTS folds_no_delete BEFORE DELETE ON folds
BEGIN SELECT RAISE(ABORT, 'folds is append-only'); END;
CREATE TRIGGER IF NOT EXISTS audit_no_update BEFORE UPDATE ON audit
BEGIN SELECT RAISE(ABORT, 'audit is append-only'); END;
CREATE TRIGGER IF NOT EXISTS audit_no_delete BEFORE DELETE ON audit
BEGIN SELECT RAISE(ABORT, 'audit is append-only'); END;
CREATE TRIGGER IF NOT EXISTS glimpses_no_update BEFORE UPDATE ON glimpses
BEGIN SELECT RAISE(ABORT, 'glimpses is append-only'); END;
CREATE TRIGGER IF NOT EXISTS glimpses_no_delete BEFORE DELETE ON glimpses
BEGIN SELECT RAISE(ABORT, 'glimpses is append-only'); END;
CREATE TRIGGER IF NOT EXISTS served_no_update BEFORE UPDATE ON served
BEGIN SELECT RAISE(ABORT, 'served is append-only'); END;
CREATE TRIGGER IF NOT EXISTS served_no_delete BEFORE DELETE ON served
BEGIN SELECT RAISE(ABORT, 'served is append-only'); END;
CREATE TRIGGER IF NOT EXISTS outcomes_no_update BEFORE UPDATE ON outcomes
BEGIN SELECT RAISE(ABORT, 'outcomes is append-only'); END;
CREATE TRIGGER IF NOT EXISTS outcomes_no_delete BEFORE DELETE ON outcomes
BEGIN SELECT RAISE(ABORT, 'outcomes is append-only'); END;
