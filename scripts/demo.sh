#!/usr/bin/env bash
# The main job on embedded defaults: start `twinkle serve` (tiny model, SQLite, local Ray), make a
# key, train a LoRA with the unmodified Tinker SDK, sample from it, stop the server.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
export TWINKLE_DATA_DIR=${TWINKLE_DATA_DIR:-$PWD/.twinkle} TINKER_TELEMETRY=0 HF_HUB_OFFLINE=1 \
       TRANSFORMERS_OFFLINE=1
PORT=${PORT:-8000}
LOG=$TWINKLE_DATA_DIR/serve.log
mkdir -p "$TWINKLE_DATA_DIR"
.venv/bin/twinkle serve --port "$PORT" >"$LOG" 2>&1 &
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
TWINKLE_SERVER_URL=http://127.0.0.1:$PORT TWINKLE_SERVER_TOKEN=$KEY \
  .venv/bin/python cookbook/client/tinker/self_host/sft_and_sample.py \
  --tokenizer-dir "$TWINKLE_DATA_DIR/models/tiny-chat" "$@"
echo "[demo] done; stopping the server"
