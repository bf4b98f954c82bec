-- One boundary per (session_id, key, t), equivalent to sqlite/0006_boundary_unique.sql (a trigger: ledgers
-- written before this file may hold duplicates, and the table is append-only).
CREATE OR REPLACE FUNCTION palimpsest_boundary_unique() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    -- serialise writers of one (session, key, t): a check alone would let two concurrent inserts both pass
    PERFORM pg_advisory_xact_lock(hashtext(NEW.session_id || '|' || NEW.key), NEW.t::int);
    IF EXISTS (SELECT 1 FROM boundaries WHERE session_id = NEW.session_id AND key = NEW.key AND t = NEW.t) THEN
        RAISE EXCEPTION 'boundaries: one boundary per (session_id, key, t)'
            USING ERRCODE = 'unique_violation';
    END IF;
    RETURN NEW;
END $$;
CREATE TRIGGER boundaries_unique BEFORE INSERT ON boundaries
    FOR EACH ROW EXECUTE FUNCTION palimpsest_boundary_unique();
