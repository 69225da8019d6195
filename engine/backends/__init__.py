"""Compute backends. They never import the gateway, FastAPI, the DB or Ray Serve."""
