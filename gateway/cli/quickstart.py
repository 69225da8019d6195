"""The cookbook's server launchers (``cookbook/client/server/*/server.py``): serve a folder's
``server_config.yaml`` and hand the client its key, with no auth-off mode.

Owns `quickstart_main`: validate the config, create an API key for the local user
``quickstart`` on the first start, write it with the server's URL to
``$TWINKLE_DATA_DIR/quickstart.json`` (mode 600; later starts reuse the key and update the URL),
print the variables a client needs, then run `twinkle serve --config`. Our clients read that file
when nothing else names a server (client/twinkle_client/local_server.py), so the quick start's
second command needs no exports.
"""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

QUICKSTART_USER = "quickstart"
#: the clients' name for it too (client/twinkle_client/local_server.py FILE_NAME)
QUICKSTART_FILE = "quickstart.json"


def quickstart_key(data_dir: Path, url: str) -> str:
    """The ``quickstart`` user's key, created once; ``{url, key}`` written to ``data_dir``."""
    from gateway.cli.keys import keys_main

    path = data_dir / QUICKSTART_FILE
    try:
        key = str(json.loads(path.read_text())["key"])
    except (OSError, ValueError, KeyError, TypeError):
        key = _create_key(keys_main)
    data_dir.mkdir(parents=True, exist_ok=True)
    path.touch(mode=0o600)
    path.chmod(0o600)
    path.write_text(json.dumps({"url": url, "key": key}) + "\n")
    return key


def _create_key(keys_main) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = keys_main(["create", "--user", QUICKSTART_USER])
    if rc != 0:
        raise SystemExit(f"could not create the {QUICKSTART_USER} key (exit {rc})")
    return out.getvalue().strip().splitlines()[-1]


def quickstart_main(config_path: str | Path) -> int:
    from gateway.cli.serve import serve_main
    from gateway.config import ServerConfig
    from gateway.settings import Settings

    config = ServerConfig.from_yaml(config_path)  # a bad config fails here, naming the key
    host = "127.0.0.1" if config.host in ("0.0.0.0", "::") else config.host
    url = f"http://{host}:{config.port}"
    key = quickstart_key(Settings.from_env().data_dir, url)
    print(
        f"[quickstart] clients on this machine (same directory) find this server by themselves;\n"
        f"[quickstart] elsewhere: export TWINKLE_SERVER_URL={url} TWINKLE_SERVER_TOKEN={key}\n"
        f"[quickstart]          (Tinker SDK: TINKER_BASE_URL={url} TINKER_API_KEY=<same key>)",
        flush=True,
    )
    return serve_main(str(config_path), None, None)
