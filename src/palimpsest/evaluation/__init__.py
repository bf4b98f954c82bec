"""Evaluation: replay over trajectories, eval-actions, eval-memory and eval-reconstruction, and their reports."""
