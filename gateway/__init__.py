"""Twinkle gateway: the HTTP edge (Tinker-compatible API, auth, ownership, futures). Owns the DB."""
