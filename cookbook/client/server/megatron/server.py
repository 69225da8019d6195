"""Start Twinkle with the Megatron backend: the quick start's first command.

    python cookbook/client/server/megatron/server.py            # server_config.yaml beside this
    TWINKLE_SERVER_CONFIG=server_config_4b.yaml python .../server.py   # the 4B GPU config

Any ``python`` works: outside the repo's ``.venv`` it installs that (once) and re-runs itself there
(cookbook/client/_bootstrap.py). It serves `server_config.yaml` next to this file (the built-in tiny
model with `use_megatron: true` over two tensor-parallel ranks, port 8000, CPU only), creates an API
key for the local user ``quickstart`` on first start and writes it with the URL to
``$TWINKLE_DATA_DIR/quickstart.json`` (mode 600), where our clients find it with nothing set; prints
the variables for clients elsewhere, and serves until Ctrl-C (gateway/cli/quickstart.py). Upstream's
launcher is ``twinkle.server.launch_server(config_path=...)``; ours is `twinkle serve --config`.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))

from _bootstrap import ensure_venv  # noqa: E402  (cookbook/client, put on sys.path)


def main() -> int:
    ensure_venv(__file__, ("gateway.cli.quickstart", "megatron.core"))
    from gateway.cli.quickstart import quickstart_main

    config = Path(os.environ.get("TWINKLE_SERVER_CONFIG", "server_config.yaml"))
    return quickstart_main(config if config.is_absolute() or config.exists() else HERE / config)


if __name__ == "__main__":
    sys.exit(main())
