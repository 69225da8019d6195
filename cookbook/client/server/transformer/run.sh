#!/usr/bin/env bash
# Start this folder's server the way a cluster runs it: a Ray head on loopback (with flags, worker
# nodes too), then server.py on that cluster; installs the venv once. Flags and their meaning:
# ../run_server.sh (e.g. --cpu-workers 2, --gpu-workers '4,5,6,7'). Another config:
# TWINKLE_SERVER_CONFIG (default: server_config.yaml next to this script).
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
exec bash "$HERE/../run_server.sh" "$HERE" "$@"
