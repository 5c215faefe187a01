#!/usr/bin/env python3
"""Launch a real Triton Inference Server that serves a kilnlm engine.

    python scripts/launch_triton.py --engine ENGINE_DIR [--address 0.0.0.0] [--http-port 8000] [--grpc-port 8001]
        [--metrics-port 8002] [--model-repository model_repository] [--tritonserver PATH]
        [--log-verbose N] [--work-dir DIR] [--poll-repository-s S] [--malloc auto|tcmalloc|jemalloc|system]
    python scripts/launch_triton.py --model-repository DIR    # a repository written by `kilnlm deploy`

The work (finding tritonserver and its Python backend stub, preparing the model repository, the server's
command line and environment, the foreground run with signal forwarding) is
:mod:`kilnlm.runtime.serving.launcher`; see its docstring. Exit status: tritonserver's, 0 when a signal
stopped it, 2 when something it needs is missing (with a message).
"""

import sys

from kilnlm.runtime.serving.launcher import main

if __name__ == "__main__":
    sys.exit(main())
