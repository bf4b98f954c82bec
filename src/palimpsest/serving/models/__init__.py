"""The model deployments: the vLLM actor (local or remote), embedder, summarizer, memory encoder, tool parsing."""
