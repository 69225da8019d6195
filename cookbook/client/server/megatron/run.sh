#!/usr/bin/env bash
# Start the Megatron-backend server from a fresh checkout: install the venv (with the megatron
# extra) if needed, then run server.py with it. Extra arguments are ignored; choose the config
# with TWINKLE_SERVER_CONFIG (default: server_config.yaml next to this script).
#   bash cookbook/client/server/megatron/run.sh
#   TWINKLE_SERVER_CONFIG=server_config_4b.yaml bash cookbook/client/server/megatron/run.sh
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../../../.." && pwd)"
bash "$ROOT/scripts/install.sh"
export HF_HUB_OFFLINE=${HF_HUB_OFFLINE:-1} TRANSFORMERS_OFFLINE=${TRANSFORMERS_OFFLINE:-1} \
       TINKER_TELEMETRY=${TINKER_TELEMETRY:-0} TWINKLE_DATA_DIR=${TWINKLE_DATA_DIR:-$ROOT/.twinkle}
cd "$ROOT"
exec "$ROOT/.venv/bin/python" "$HERE/server.py"
