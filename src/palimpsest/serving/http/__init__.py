"""HTTP: the FastAPI server, errors in each protocol's shape, sessions and tenants, and the OpenAI Chat,
Responses and Anthropic Messages routes (a protocol module and a proxy module each)."""
