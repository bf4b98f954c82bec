-- Rollouts (serving/candidates.py, pipelines/rollouts.py): the paired shadow record of a candidate arm, scored on
-- a live turn of its control against the same reference, and every decision on a candidate's stage (dark,
-- canary, promoted, withdrawn) with its evidence, which every replica's router reads. `subject` names what is
-- judged (the candidate's policy config and memory model): a new memory model starts its own history.
CREATE TABLE IF NOT EXISTS shadow_pairs (
    id INTEGER PRIMARY KEY AUTOINCREMENT, session_id TEXT NOT NULL REFERENCES sessions(id), t INTEGER NOT NULL,
    control TEXT NOT NULL, candidate TEXT NOT NULL, subject TEXT NOT NULL, status TEXT NOT NULL,
    reason TEXT NOT NULL, reference TEXT NOT NULL, control_kl REAL, control_top1 REAL, candidate_kl REAL,
    candidate_top1 REAL, control_tokens INTEGER NOT NULL, candidate_tokens INTEGER NOT NULL,
    tokens INTEGER NOT NULL, created REAL NOT NULL);
CREATE INDEX IF NOT EXISTS shadow_pairs_candidate ON shadow_pairs (candidate, subject, id);
CREATE TRIGGER IF NOT EXISTS shadow_pairs_no_update BEFORE UPDATE ON shadow_pairs
BEGIN SELECT RAISE(ABORT, 'shadow_pairs is append-only'); END;
CREATE TRIGGER IF NOT EXISTS shadow_pairs_no_delete BEFORE DELETE ON shadow_pairs
BEGIN SELECT RAISE(ABORT, 'shadow_pairs is append-only'); END;
-- `prev`: the decision this one follows (0: the first of its candidate and subject). A decision taken on a stale
-- view (another replica decided first) is refused, so each candidate's history is one line.
CREATE TABLE IF NOT EXISTS rollouts (
    id INTEGER PRIMARY KEY AUTOINCREMENT, candidate TEXT NOT NULL, control TEXT NOT NULL, subject TEXT NOT NULL,
    prev INTEGER NOT NULL, stage TEXT NOT NULL, decision TEXT NOT NULL, evidence TEXT NOT NULL,
    created REAL NOT NULL);
CREATE INDEX IF NOT EXISTS rollouts_candidate ON rollouts (candidate, subject, id);
CREATE TRIGGER IF NOT EXISTS rollouts_no_update BEFORE UPDATE ON rollouts
BEGIN SELECT RAISE(ABORT, 'rollouts is append-only'); END;
CREATE TRIGGER IF NOT EXISTS rollouts_no_delete BEFORE DELETE ON rollouts
BEGIN SELECT RAISE(ABORT, 'rollouts is append-only'); END;
CREATE TRIGGER IF NOT EXISTS rollouts_linear BEFORE INSERT ON rollouts
WHEN NEW.prev != COALESCE((SELECT MAX(id) FROM rollouts WHERE candidate = NEW.candidate AND subject = NEW.subject), 0)
BEGIN SELECT RAISE(ABORT, 'rollouts: a decision must follow the latest of its candidate'); END;
