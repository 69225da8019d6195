"""Lets ``python cookbook/client/server/<backend>/server.py`` run under any python: outside the
repo's ``.venv`` it installs that once (scripts/install.sh: CPU torch and the megatron extra,
pinned by constraints.txt) and re-runs the script there. Standard library only."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def ensure_venv(script: str, modules: tuple[str, ...]) -> None:
    """Return if ``modules`` import here; otherwise re-exec ``script`` in the repo's .venv."""
    try:
        for name in modules:
            importlib.import_module(name)
    except ImportError:
        pass
    else:
        return
    venv_python = ROOT / ".venv" / "bin" / "python"
    if Path(sys.executable).resolve() == venv_python.resolve():
        raise SystemExit(f"the .venv lacks {', '.join(modules)}: run bash scripts/install.sh")
    if not (ROOT / ".venv" / ".twinkle-installed").exists():
        print("[quickstart] installing .venv (scripts/install.sh; a few minutes, once)", flush=True)
        subprocess.run(["bash", str(ROOT / "scripts" / "install.sh")], check=True)
    target = str(Path(script).resolve())
    os.execv(str(venv_python), [str(venv_python), target, *sys.argv[1:]])
