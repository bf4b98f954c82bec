"""A tiny random Llama actor, built in the test (seconds), as ENVIRONMENT.md prescribes for unit tests."""

import torch

from palimpsest.models.actor import FrozenActor


def tiny_actor(seed: int = 0, hidden: int = 64, vocab: int = 256, heads: int = 4) -> FrozenActor:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
                      num_attention_heads=heads, num_key_value_heads=2, max_position_embeddings=2048,
                      tie_word_embeddings=True)
    return FrozenActor(LlamaForCausalLM(cfg).float())
