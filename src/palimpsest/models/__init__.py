"""The models beside the platform: the frozen actor, the memory network and its config and bundle registry,
the memory encoder (the serving hook), the shadow scorer, the embedder and the relevance head's bundle."""
