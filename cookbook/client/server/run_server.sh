#!/usr/bin/env bash
# Shared by cookbook/client/server/*/run.sh: the deployment path of a real cluster, on one machine.
# Installs the venv if needed, starts a Ray head (and, with flags, worker nodes), then that folder's
# server.py on that cluster (it joins through RAY_ADDRESS: gateway/cli/serve.py). Ctrl-C or SIGTERM
# stops the server, then the Ray nodes started here, and nothing else (never `ray stop`, which
# would kill every Ray on the machine).
#
#   run_server.sh <folder> [--ray-port P] [--head-cpus N] [--head-gpus IDS]
#                          [--cpu-workers N] [--worker-cpus N] [--gpu-workers 'IDS;IDS...']
#
# Without worker flags the head is one node with every socket on 127.0.0.1 (Ray's single-node
# mode, RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0). With --cpu-workers / --gpu-workers Ray needs its
# cluster mode, where nodes talk over the host's address; Ray's token authentication is on in
# both (RAY_AUTH_MODE=token, the token in $TWINKLE_DATA_DIR/ray_auth_token, mode 600), so nothing
# without the token joins or submits work. Other machines join the same way:
#   RAY_AUTH_MODE=token RAY_AUTH_TOKEN_PATH=<copy of the token> ray start --address=<head>:<port>
# TWINKLE_SERVER_CONFIG picks another config (default: the folder's server_config.yaml).
set -euo pipefail
DIR="$(cd "$1" && pwd)"
shift
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../../.." && pwd)"
RAY_PORT=${TWINKLE_RAY_PORT:-6390}  # not 6379: that is Redis's port
HEAD_CPUS=$(( $(nproc) > 4 ? $(nproc) : 4 ))  # fractional replicas: CPUs are only for scheduling
HEAD_GPUS="" CPU_WORKERS=0 WORKER_CPUS=1 GPU_WORKERS=""
usage() { sed -n '9,10p' "${BASH_SOURCE[0]}" | sed 's/^# *//' >&2; exit 2; }
while [[ $# -gt 0 ]]; do
  [[ $# -ge 2 ]] || { echo "run_server.sh: $1 needs a value" >&2; usage; }
  case "$1" in
    --ray-port) RAY_PORT=$2 ;;
    --head-cpus) HEAD_CPUS=$2 ;;
    --head-gpus) HEAD_GPUS=$2 ;;
    --cpu-workers) CPU_WORKERS=$2 ;;
    --worker-cpus) WORKER_CPUS=$2 ;;
    --gpu-workers) GPU_WORKERS=$2 ;;
    *) echo "run_server.sh: unknown flag $1" >&2; usage ;;
  esac
  shift 2
done
for v in RAY_PORT HEAD_CPUS CPU_WORKERS WORKER_CPUS; do
  [[ ${!v} =~ ^[0-9]+$ ]] || { echo "run_server.sh: ${v,,} must be a whole number, got '${!v}'" >&2; exit 2; }
done

bash "$ROOT/scripts/install.sh"
export HF_HUB_OFFLINE=${HF_HUB_OFFLINE:-1} TRANSFORMERS_OFFLINE=${TRANSFORMERS_OFFLINE:-1} \
       TINKER_TELEMETRY=${TINKER_TELEMETRY:-0} TWINKLE_DATA_DIR=${TWINKLE_DATA_DIR:-$PWD/.twinkle}
mkdir -p "$TWINKLE_DATA_DIR"
TWINKLE_DATA_DIR="$(cd "$TWINKLE_DATA_DIR" && pwd)"
RAY="$ROOT/.venv/bin/ray"
export RAY_USAGE_STATS_ENABLED=0 RAY_AUTH_MODE=token \
       RAY_AUTH_TOKEN_PATH=${RAY_AUTH_TOKEN_PATH:-$TWINKLE_DATA_DIR/ray_auth_token}
if [[ ! -s $RAY_AUTH_TOKEN_PATH ]]; then
  (umask 077 && "$ROOT/.venv/bin/python" -c "import secrets; print(secrets.token_hex(32))" \
    > "$RAY_AUTH_TOKEN_PATH")
fi
if [[ $CPU_WORKERS -eq 0 && -z $GPU_WORKERS ]]; then
  export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0  # one node: every Ray socket on loopback
fi
# A short private temp dir: Ray's unix sockets live under it (107-byte path limit), and its
# ray_current_cluster file stays out of /tmp/ray, where a bare ray.init() elsewhere would find it.
RAY_TMP=$(mktemp -d /tmp/twinkle-ray.XXXXXX)
LOGS="$TWINKLE_DATA_DIR/ray-nodes"
mkdir -p "$LOGS"
PIDS=()
SERVER_PID=""
cleanup() {
  trap - EXIT INT TERM
  if [[ -n $SERVER_PID ]] && kill -0 "$SERVER_PID" 2>/dev/null; then
    kill -TERM "$SERVER_PID" 2>/dev/null || true
    wait "$SERVER_PID" 2>/dev/null || true
  fi
  # workers first, the head last; `ray start --block` stops its node's processes on SIGTERM
  for ((i = ${#PIDS[@]} - 1; i >= 0; i--)); do
    kill -TERM "${PIDS[i]}" 2>/dev/null || true
    wait "${PIDS[i]}" 2>/dev/null || true
  done
  rm -rf "$RAY_TMP"
  echo "[run.sh] Ray nodes stopped" >&2
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

start_node() {  # start_node <name> <ray start args...>: background `ray start --block`, wait ready
  local name=$1 log="$LOGS/$1.log"
  shift
  "$RAY" start --block --disable-usage-stats "$@" >"$log" 2>&1 &
  PIDS+=($!)
  for _ in $(seq 120); do
    grep -q "Ray runtime started" "$log" && return 0
    kill -0 "${PIDS[-1]}" 2>/dev/null || break
    sleep 0.5
  done
  echo "[run.sh] Ray $name did not start; its log ($log):" >&2
  tail -20 "$log" >&2
  exit 1
}

head_args=(--head --node-ip-address=127.0.0.1 --port="$RAY_PORT" --num-cpus="$HEAD_CPUS"
           --include-dashboard=false --temp-dir="$RAY_TMP")
if [[ -n $HEAD_GPUS ]]; then
  head_args+=(--num-gpus="$(tr ',' '\n' <<<"$HEAD_GPUS" | grep -c .)")
  CUDA_VISIBLE_DEVICES=$HEAD_GPUS start_node head "${head_args[@]}"
elif [[ -n $GPU_WORKERS ]]; then
  start_node head "${head_args[@]}" --num-gpus=0  # the GPUs belong to the workers
else
  start_node head "${head_args[@]}"
fi
ADDRESS="127.0.0.1:$RAY_PORT"
echo "[run.sh] Ray head at $ADDRESS (temp dir: $RAY_TMP, node logs: $LOGS)" >&2
# Worker nodes get --temp-dir too: without it `ray start --address` records the cluster in
# /tmp/ray/ray_current_cluster, and once this cluster is gone a bare ray.init() anywhere on the
# machine fails on that dead address ("When connecting to an existing cluster, num_cpus ...").
worker_args=(--address="$ADDRESS" --node-ip-address=127.0.0.1 --temp-dir="$RAY_TMP")
for ((i = 1; i <= CPU_WORKERS; i++)); do
  start_node "cpu-worker-$i" "${worker_args[@]}" --num-cpus="$WORKER_CPUS" --num-gpus=0
done
if [[ -n $GPU_WORKERS ]]; then
  IFS=';' read -ra groups <<<"$GPU_WORKERS"
  for i in "${!groups[@]}"; do
    ids=${groups[i]}
    CUDA_VISIBLE_DEVICES=$ids start_node "gpu-worker-$((i + 1))" "${worker_args[@]}" \
      --num-gpus="$(tr ',' '\n' <<<"$ids" | grep -c .)"
  done
fi
echo "[run.sh] $((${#PIDS[@]} - 1)) worker node(s) joined" >&2

RAY_ADDRESS=$ADDRESS "$ROOT/.venv/bin/python" "$DIR/server.py" &
SERVER_PID=$!
wait "$SERVER_PID"
