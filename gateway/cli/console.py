"""`twinkle console`: start the operators' admin console (admin_ui/app.py) with Streamlit.

Owns the command line only: it finds the installed ``admin_ui`` package without importing it
(the console is a separate client of the admin REST API, not part of the gateway) and replaces
this process with ``streamlit run``, bound to 127.0.0.1 unless ``--host`` says otherwise (the
console holds an admin key in its sessions: do not expose it without a proxy that adds TLS and
access control). The gateway URL reaches the app as ``TWINKLE_GATEWAY_URL``.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
from pathlib import Path

DEFAULT_GATEWAY = "http://127.0.0.1:8000"


def app_path() -> Path:
    spec = importlib.util.find_spec("admin_ui")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the admin_ui package is not installed (pip install -e .)")
    return Path(next(iter(spec.submodule_search_locations))) / "app.py"


def streamlit_argv(app: Path, host: str, port: int) -> list[str]:
    return [
        sys.executable,
        "-m",
        "streamlit",
        "run",
        str(app),
        "--server.headless",
        "true",
        "--server.address",
        host,
        "--server.port",
        str(port),
        "--browser.gatherUsageStats",
        "false",
        # no "Deploy" button or developer menu: this is an operators' tool, not a demo app
        "--client.toolbarMode",
        "viewer",
        # the pages show errors as one line themselves; this is the backstop: no traceback
        "--client.showErrorDetails",
        "none",
    ]


def console_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog="twinkle console",
        description="Start the admin console (Streamlit); sign in with an admin API key.",
    )
    p.add_argument(
        "--gateway",
        default=os.environ.get("TWINKLE_GATEWAY_URL", DEFAULT_GATEWAY),
        help=f"the gateway's URL (default: $TWINKLE_GATEWAY_URL or {DEFAULT_GATEWAY})",
    )
    p.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8501, help="port (default 8501)")
    a = p.parse_args(argv)
    try:
        app = app_path()
    except FileNotFoundError as e:
        print(f"twinkle console: {e}", file=sys.stderr)
        return 2
    if importlib.util.find_spec("streamlit") is None:
        print("twinkle console: streamlit is not installed (pip install -e .)", file=sys.stderr)
        return 2
    print(f"Twinkle console at http://{a.host}:{a.port} (gateway {a.gateway})", flush=True)
    env = dict(os.environ, TWINKLE_GATEWAY_URL=a.gateway)
    argv_ = streamlit_argv(app, a.host, a.port)
    os.execve(sys.executable, argv_, env)
    return 0  # not reached: execve replaces this process
