"""The cookbook's server launchers (``cookbook/client/server/*/server.py``): serve a folder's
``server_config.yaml`` and hand the client its key, with no auth-off mode.

Owns `quickstart_main`: validate the config, create an API key for the local user
``quickstart`` on the first start (kept, mode 600, in ``$TWINKLE_DATA_DIR/quickstart.key``;
later starts reuse it), print the variables a client needs, then run `twinkle serve --config`.
"""

from __future__ import annotations

import contextlib
import io
from pathlib import Path

QUICKSTART_USER = "quickstart"
KEY_FILE = "quickstart.key"


def quickstart_key(data_dir: Path) -> str:
    """The ``quickstart`` user's key: read from ``data_dir``, or created there once."""
    from gateway.cli.keys import keys_main

    path = data_dir / KEY_FILE
    if path.exists():
        return path.read_text().strip()
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = keys_main(["create", "--user", QUICKSTART_USER])
    if rc != 0:
        raise SystemExit(f"could not create the {QUICKSTART_USER} key (exit {rc})")
    key = out.getvalue().strip().splitlines()[-1]
    data_dir.mkdir(parents=True, exist_ok=True)
    path.touch(mode=0o600)
    path.write_text(key + "\n")
    return key


def quickstart_main(config_path: str | Path) -> int:
    from gateway.cli.serve import serve_main
    from gateway.config import ServerConfig
    from gateway.settings import Settings

    config = ServerConfig.from_yaml(config_path)  # a bad config fails here, naming the key
    key = quickstart_key(Settings.from_env().data_dir)
    host = "127.0.0.1" if config.host in ("0.0.0.0", "::") else config.host
    url = f"http://{host}:{config.port}"
    print(
        f"[quickstart] clients: export TWINKLE_SERVER_URL={url} TWINKLE_SERVER_TOKEN={key}\n"
        f"[quickstart]          (Tinker SDK: TINKER_BASE_URL={url} TINKER_API_KEY=<same key>)",
        flush=True,
    )
    return serve_main(str(config_path), None, None)
