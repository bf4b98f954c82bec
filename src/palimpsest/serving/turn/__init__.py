"""The served turn: the ingress replica, the turn itself, enrichment, the shadow lane, candidates and the A/B router."""
