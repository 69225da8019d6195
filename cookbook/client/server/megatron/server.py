"""Start Twinkle with the Megatron backend: the quick start's first command.

    python cookbook/client/server/megatron/server.py            # server_config.yaml beside this
    TWINKLE_SERVER_CONFIG=server_config_4b.yaml python .../server.py   # the 4B GPU config

Any ``python`` works: outside the repo's ``.venv`` it installs that (once) and re-runs itself there.
Reads `server_config.yaml` next to this file (the built-in tiny model with `use_megatron: true`
on port 8000, CPU-only, so it runs anywhere), creates an API key for the local user
``quickstart`` on first start (kept in ``$TWINKLE_DATA_DIR/quickstart.key``) and prints the two
variables a client needs, then serves until Ctrl-C. Upstream's launcher is
``twinkle.server.launch_server(config_path=...)``; ours is `twinkle serve --config`, which this
calls, so everything `twinkle serve` does (Ray, the DB migrations, the gateway) happens here.
"""

from __future__ import annotations

import contextlib
import io
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[3]


def _ensure_venv() -> None:
    """Run under the repo's .venv: a plain ``python server.py`` from a fresh checkout installs it
    (scripts/install.sh: CPU torch, the megatron extra, pinned by constraints.txt) and re-runs
    this script with it."""
    try:
        import megatron.core  # noqa: F401

        import gateway.cli.serve  # noqa: F401
    except ImportError:
        pass
    else:
        return
    venv_python = ROOT / ".venv" / "bin" / "python"
    if Path(sys.executable).resolve() == venv_python.resolve():
        raise SystemExit("the .venv lacks twinkle or megatron-core: run bash scripts/install.sh")
    if not venv_python.exists() or not (ROOT / ".venv" / ".twinkle-installed").exists():
        print("[quickstart] installing .venv (scripts/install.sh; a few minutes, once)", flush=True)
        subprocess.run(["bash", str(ROOT / "scripts" / "install.sh")], check=True)
    os.execv(str(venv_python), [str(venv_python), str(Path(__file__).resolve()), *sys.argv[1:]])


def _quickstart_key(data_dir: Path) -> str:
    """A key for user ``quickstart``, made once and kept under the data dir (mode 600)."""
    from gateway.cli.keys import keys_main

    path = data_dir / "quickstart.key"
    if path.exists():
        return path.read_text().strip()
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = keys_main(["create", "--user", "quickstart"])
    if rc != 0:
        raise SystemExit(f"could not create the quickstart key (exit {rc})")
    key = out.getvalue().strip().splitlines()[-1]
    data_dir.mkdir(parents=True, exist_ok=True)
    path.write_text(key + "\n")
    path.chmod(0o600)
    return key


def main() -> int:
    _ensure_venv()
    from gateway.cli.serve import serve_main
    from gateway.config import ServerConfig
    from gateway.settings import Settings

    config_path = Path(os.environ.get("TWINKLE_SERVER_CONFIG", HERE / "server_config.yaml"))
    if not config_path.is_absolute() and not config_path.exists():
        config_path = HERE / config_path
    config = ServerConfig.from_yaml(config_path)  # a bad config fails here, naming the key
    key = _quickstart_key(Settings.from_env().data_dir)
    url = f"http://{'127.0.0.1' if config.host in ('0.0.0.0', '::') else config.host}:{config.port}"
    print(
        f"[quickstart] clients: export TWINKLE_SERVER_URL={url} TWINKLE_SERVER_TOKEN={key}\n"
        f"[quickstart]          (Tinker SDK: TINKER_BASE_URL={url} TINKER_API_KEY=<same key>)",
        flush=True,
    )
    return serve_main(str(config_path), None, None)


if __name__ == "__main__":
    sys.exit(main())
