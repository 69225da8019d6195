"""Finding a local quick-start server with nothing set.

`twinkle serve` started through the cookbook's launchers (cookbook/client/server/*/server.py,
gateway/cli/quickstart.py) writes ``quickstart.json`` — ``{"url": ..., "key": ...}``, mode 600 —
into its data dir (``$TWINKLE_DATA_DIR``, default ``./.twinkle``). When neither an argument nor
``TWINKLE_SERVER_URL`` / ``TWINKLE_SERVER_TOKEN`` give a server, the clients read that file, so
the quick start's second command needs no exports. The key is only ever sent to the loopback URL
written beside it: an explicit non-local URL never picks it up.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from urllib.parse import urlparse

FILE_NAME = "quickstart.json"
LOOPBACK = ("127.0.0.1", "localhost", "::1")


def quickstart_file() -> Path:
    return Path(os.environ.get("TWINKLE_DATA_DIR") or ".twinkle") / FILE_NAME


def is_loopback(url: str) -> bool:
    return urlparse(url).hostname in LOOPBACK


def resolve(url: str | None, key: str | None) -> tuple[str | None, str | None]:
    """``(url, key)`` as given, with gaps filled from a local quick-start server's file."""
    if url and key:
        return url, key
    try:
        local = json.loads(quickstart_file().read_text())
        local_url, local_key = str(local["url"]), str(local["key"])
    except (OSError, ValueError, KeyError, TypeError):
        return url, key
    if not is_loopback(local_url) or (url and url.rstrip("/") != local_url.rstrip("/")):
        return url, key
    return url or local_url, key or local_key
