#!/usr/bin/env bash
# Install if needed, then run the whole test suite (unit, gateway, e2e with a real `twinkle serve`).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TINKER_TELEMETRY=0 RAY_USAGE_STATS_ENABLED=0 \
       RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0
exec .venv/bin/python -m pytest -q "$@"
