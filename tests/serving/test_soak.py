"""The CI-sized soak (issue 26, item 2): ``scripts/soak.py``'s request mix -- Triton ``ensemble`` and
``tensorrt_llm`` over gRPC streams, HTTP and server-sent events, OpenAI chat / completions through ``kilnlm
serve`` streamed and not; shared prefixes, stop words, sampling, a fraction abandoned mid-stream and a
fraction that must be refused -- against SmolLM2 on a real tritonserver and a real ``kilnlm serve``. Each front
first takes a warm-up round, then the measured one: nothing lost, nothing failed, no KV block held once the
server drained, and the server's memory (its whole process tree) grows by less than MEMORY_GROWTH_MB over the
measured round."""

from __future__ import annotations

import importlib.util
import random
import sys
from pathlib import Path

import pytest
from servers import running_kilnlm_serve

pytestmark = [pytest.mark.e2e]

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "soak.py"
WARM_UP_REQUESTS = 30
MEASURED_REQUESTS = 120
CONCURRENCY = 8
# Allocator pools, gRPC / HTTP buffers and Python's own caches settle during the warm-up; a leak of one KV
# block's worth of host memory per request (SmolLM2 fp32: 30 layers x 2 x 32 tokens x 3 heads x 64 x 4 bytes
# = 1.4 MB) would grow the server by over 160 MB in the measured round.
MEMORY_GROWTH_MB = 128


def load_soak():
    """scripts/soak.py as the module ``soak`` (registered in sys.modules, as its dataclasses need)."""
    if "soak" not in sys.modules:
        spec = importlib.util.spec_from_file_location("soak", SCRIPT)
        module = importlib.util.module_from_spec(spec)
        sys.modules["soak"] = module
        spec.loader.exec_module(module)
    return sys.modules["soak"]


def soak_rounds(soak, front, pid: int, seed: int) -> tuple[dict, dict]:
    """A warm-up round then the measured round on ``front``; their reports."""
    words = soak.english_words()
    reports = []
    for num_requests, round_seed in ((WARM_UP_REQUESTS, f"{seed}:warm-up"), (MEASURED_REQUESTS, f"{seed}:measured")):
        plan = soak.make_plan(front.name, num_requests, random.Random(round_seed), words, max_tokens=32,
                              max_prompt_words=160, cancel_fraction=0.15, bad_fraction=0.03)
        reports.append(soak.soak_front(front, plan, CONCURRENCY, duration_s=600, timeout_s=120, drain_timeout_s=60,
                                       server_pid=pid))
    return reports[0], reports[1]


def check(soak, warm_up: dict, measured: dict) -> None:
    report = soak.format_report(warm_up) + "\n" + soak.format_report(measured)
    for round_report in (warm_up, measured):
        assert soak.healthy(round_report), report
    assert measured["sent"] == MEASURED_REQUESTS, report
    assert measured["completed"] > MEASURED_REQUESTS // 2 and measured["cancelled"] > 0 and measured["refused"] > 0, report
    assert measured["ttft_ms"]["count"] > 0 and measured["itl_ms"]["count"] > 0, report
    growth_mb = measured["rss"]["end_mb"] - measured["rss"]["start_mb"]
    assert growth_mb < MEMORY_GROWTH_MB, report
    print(report)


@pytest.mark.triton
def test_soak_triton(triton_server, smollm2_engine_fp32_dir):
    soak = load_soak()
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(Path(smollm2_engine_fp32_dir) / "tokenizer" / "tokenizer.json"))
    front = soak.TritonFront(triton_server.http_url, triton_server.grpc_address, triton_server.metrics_url,
                             tokenizer, timeout_s=120)
    check(soak, *soak_rounds(soak, front, triton_server.process.pid, seed=26))


def test_soak_kilnlm_serve(smollm2_engine_fp32_dir, tmp_path):
    soak = load_soak()
    with running_kilnlm_serve(["--engine", str(smollm2_engine_fp32_dir)], tmp_path) as served:
        front = soak.OpenAIFront(served.url, timeout_s=120)
        check(soak, *soak_rounds(soak, front, served.process.pid, seed=26))
