#!/usr/bin/env python3
"""Ask a kilnlm model served by Triton a question over gRPC streaming, printing tokens as they arrive.

    python scripts/ask.py [--url localhost:8001] [--model ensemble] [--max-tokens 64] [--chat] "question"

Waits up to ``--wait-s`` seconds for the server to be ready. Sends TensorRT-LLM's inflight_batcher_llm
ensemble tensors (text_input, max_tokens, stream -> text_output; ``[1, 1]``-shaped, batch first), so the
same client works against either server (``--no-chat`` there: the chat template is a kilnlm extension).
"""

from __future__ import annotations

import argparse
import queue
import sys
import time

import numpy as np
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException


def _input(name: str, value, dtype: str) -> grpcclient.InferInput:
    array = np.array([[value]], dtype=object if dtype == "BYTES" else None)
    if dtype != "BYTES":
        array = array.astype({"INT32": np.int32, "BOOL": np.bool_, "FP32": np.float32}[dtype])
    tensor = grpcclient.InferInput(name, list(array.shape), dtype)
    tensor.set_data_from_numpy(array)
    return tensor


def wait_until_ready(client: grpcclient.InferenceServerClient, model: str, wait_s: float) -> None:
    deadline = time.monotonic() + wait_s
    while True:
        try:
            if client.is_server_ready() and client.is_model_ready(model):
                return
        except InferenceServerException:
            pass
        if time.monotonic() > deadline:
            raise SystemExit(f"ask.py: server at {client._channel._channel.target().decode()} not ready after {wait_s:.0f} s")
        time.sleep(0.5)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("question")
    parser.add_argument("--url", default="localhost:8001", help="Triton gRPC address host:port (default: localhost:8001)")
    parser.add_argument("--model", default="ensemble",
                        help="model name in the repository: ensemble or tensorrt_llm_bls (default: ensemble)")
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens to generate at most (default: 64)")
    parser.add_argument("--chat", action=argparse.BooleanOptionalAction, default=True,
                        help="apply the model's chat template (default: on)")
    parser.add_argument("--wait-s", type=float, default=120.0, help="seconds to wait for the server (default: 120)")
    args = parser.parse_args()

    responses: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(args.url)
    wait_until_ready(client, args.model, args.wait_s)
    inputs = [
        _input("text_input", args.question.encode(), "BYTES"),
        _input("max_tokens", args.max_tokens, "INT32"),
        _input("stream", True, "BOOL"),
    ]
    if args.chat:
        inputs.append(_input("apply_chat_template", True, "BOOL"))
    client.start_stream(callback=lambda result, error: responses.put((result, error)))
    client.async_stream_infer(args.model, inputs, enable_empty_final_response=True)
    print(f"Q: {args.question}\nA: ", end="", flush=True)
    while True:
        result, error = responses.get(timeout=300)
        if error is not None:
            print(f"\nask.py: server error: {error}", file=sys.stderr)
            return 1
        if result.as_numpy("text_output") is not None:
            for piece in result.as_numpy("text_output").reshape(-1):
                print(piece.decode(), end="", flush=True)
        if result.get_response().parameters["triton_final_response"].bool_param:
            break
    print()
    client.stop_stream()
    return 0


if __name__ == "__main__":
    sys.exit(main())
