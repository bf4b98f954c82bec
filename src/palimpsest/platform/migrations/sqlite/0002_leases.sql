-- Work leases: which replica enriches which session right now. Operational state, not history:
-- rows are claimed, renewed and taken over when expired, so this table is not append-only.
CREATE TABLE IF NOT EXISTS leases (name TEXT PRIMARY KEY, owner TEXT NOT NULL, expires REAL NOT NULL);
