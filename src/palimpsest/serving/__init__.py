"""Serving: the composed Ray Serve app (app.py, serve_config.py, local.py, metrics.py) and its three parts:
http/ (routes and wire formats), models/ (the model deployments) and turn/ (the served turn and its A/B lanes)."""
