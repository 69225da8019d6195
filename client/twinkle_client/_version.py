"""The client's version (sent to the server when a session is created)."""

__version__ = "0.3.0"
