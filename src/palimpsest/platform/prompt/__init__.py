"""The prompt: how a step looks at each resolution (render, abstraction, names, masking), the chat
messages and the actor's token ids (chat, tokens, toolcalls)."""
