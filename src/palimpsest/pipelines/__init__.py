"""What every job reads: trajectories (import, hash halves), a runtime over a ledger, the served turns walked
over trajectories, MLflow tracking, and `palimpsest view`."""
