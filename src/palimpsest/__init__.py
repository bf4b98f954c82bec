"""Palimpsest: working memory for long-horizon LLM agents. Compress the view, never the source."""

__version__ = "0.1.0"
