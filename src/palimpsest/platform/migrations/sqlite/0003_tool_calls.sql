-- A step's tool calls and the tool results that answer them, structurally: JSON text
-- {"tool_calls": [{"id", "name", "arguments"}], "results": [{"role", "tool_call_id", "name", "chars"}]}
-- (the results' texts are the observation, in order, joined by newlines; `chars` splits it back).
-- NULL for steps without structure. Adding a nullable column rewrites no row.
ALTER TABLE steps ADD COLUMN calls TEXT;
