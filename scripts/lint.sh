#!/usr/bin/env bash
# The guardrails: ruff (rules in pyproject.toml), pyright (basic, pyrightconfig.json) over gateway/,
# engine/, client/ and admin_ui/, and the import contracts (.importlinter). Any finding fails; CI
# runs this beside the tests. The pyright wheel carries its JavaScript and runs it on the machine's Node.js
# (these machines ship Node 20), so nothing is downloaded at run time.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
echo "[lint] ruff" >&2
.venv/bin/ruff check gateway engine client admin_ui tests benchmarks cookbook scripts migrations
.venv/bin/ruff format --check gateway engine client admin_ui
echo "[lint] import contracts" >&2
.venv/bin/lint-imports
echo "[lint] pyright" >&2
.venv/bin/pyright --warnings  # a pyright warning fails too
