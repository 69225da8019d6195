#!/usr/bin/env bash
# Shared by cookbook/client/server/*/run.sh: install the venv if needed, then run that folder's
# server.py with it (TWINKLE_SERVER_CONFIG picks another config; default: the folder's
# server_config.yaml). Usage: run_server.sh <folder>
set -euo pipefail
DIR="$(cd "$1" && pwd)"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../../.." && pwd)"
bash "$ROOT/scripts/install.sh"
export HF_HUB_OFFLINE=${HF_HUB_OFFLINE:-1} TRANSFORMERS_OFFLINE=${TRANSFORMERS_OFFLINE:-1} \
       TINKER_TELEMETRY=${TINKER_TELEMETRY:-0} TWINKLE_DATA_DIR=${TWINKLE_DATA_DIR:-$ROOT/.twinkle}
cd "$ROOT"
exec "$ROOT/.venv/bin/python" "$DIR/server.py"
