#!/usr/bin/env bash
# Runs kilnlm's test suite on a fresh machine: sets up the venv (torch, then kilnlm[test]) and runs pytest.
# Extra arguments go to pytest, e.g. `bash scripts/test.sh tests/runtime -x`.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup_env.sh "test"
start_s=$(date +%s)
set +e
"$KILNLM_PY" -m pytest "$@"
status=$?
set -e
echo "[test] pytest finished in $(( $(date +%s) - start_s )) s with exit status $status" >&2
exit $status
