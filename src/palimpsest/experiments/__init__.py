"""Experiments: A/B statistics (anytime-valid tests), the rollout gate, the A/B report and live A/B."""
