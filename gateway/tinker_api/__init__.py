"""The Tinker-compatible API (`/api/v1/...`), spoken by the unmodified tinker SDK."""
