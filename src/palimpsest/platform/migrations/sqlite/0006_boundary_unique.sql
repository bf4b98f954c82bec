-- One boundary per (session_id, key, t): a replica that loses a compaction race serves the winner's row
-- (Ledger.add_boundary checks under the session's lock; this refuses any other writer). A trigger, not a
-- unique index: ledgers written before this file may hold duplicates, and the table is append-only.
CREATE TRIGGER IF NOT EXISTS boundaries_unique BEFORE INSERT ON boundaries
WHEN EXISTS (SELECT 1 FROM boundaries WHERE session_id = NEW.session_id AND key = NEW.key AND t = NEW.t)
BEGIN SELECT RAISE(ABORT, 'boundaries: one boundary per (session_id, key, t)'); END;
