"""Lets the cookbook's scripts run as ``python cookbook/client/...`` under any python: when what a
script needs does not import, it re-runs the script in the repo's ``.venv``, which the servers
(``server/*/server.py``) install once (scripts/install.sh: CPU torch and the megatron extra,
pinned by constraints.txt). Clients installed elsewhere (``pip install ./client``) never get
here: their imports succeed. Standard library only."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def ensure_venv(script: str, modules: tuple[str, ...], *, install: bool = True) -> None:
    """Return if ``modules`` import here; otherwise re-exec ``script`` in the repo's .venv
    (installing it first when ``install``; a client script only waits for the server's)."""
    try:
        for name in modules:
            importlib.import_module(name)
    except ImportError:
        pass
    else:
        return
    venv_python = ROOT / ".venv" / "bin" / "python"
    # sys.prefix, not the executable: a venv's python is a symlink to the base interpreter, so
    # resolved paths cannot tell "inside .venv" from "the python .venv was built from"
    if Path(sys.prefix).resolve() == (ROOT / ".venv").resolve():
        raise SystemExit(f"the .venv lacks {', '.join(modules)}: run bash scripts/install.sh")
    if not (ROOT / ".venv" / ".twinkle-installed").exists():
        if not install:
            raise SystemExit(
                f"{', '.join(modules)} not importable here and {ROOT / '.venv'} is not installed "
                "yet: start the server first (cookbook/client/server/*/server.py installs it), "
                "or pip install ./client"
            )
        print("[quickstart] installing .venv (scripts/install.sh; a few minutes, once)", flush=True)
        subprocess.run(["bash", str(ROOT / "scripts" / "install.sh")], check=True)
    target = str(Path(script).resolve())
    os.execv(str(venv_python), [str(venv_python), target, *sys.argv[1:]])
