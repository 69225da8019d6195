#!/usr/bin/env bash
# Start this folder's server from a fresh checkout (installs the venv once). Choose another config
# with TWINKLE_SERVER_CONFIG (default: server_config.yaml next to this script).
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
exec bash "$HERE/../run_server.sh" "$HERE"
