"""Accounts: API keys and request authentication (`keys`), JWTs (`jwt`), organizations, users and
key operations (`service`), the audit log (`audit`) and the usage ledger (`usage`)."""
