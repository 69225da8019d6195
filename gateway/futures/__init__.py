"""Futures of asynchronous Tinker requests: the store with its idempotency claims and replica
takeover (`store`), its record types (`record`), and the key-value store it mirrors to (`kv`:
in process, or Redis when gateway replicas share state)."""
