"""Tensor parallelism end to end: ``--tp-size`` builds (Megatron sharding, one engine per rank), the runtime's
rank processes joined over gloo, and their agreement with the one-rank engine."""

from __future__ import annotations

import os
import re
import signal
from pathlib import Path

import pytest
import torch
from conftest import TINY_ENGINE_LIMITS, build_test_engine
from factories import make_engine_inputs, run_in_flight

from kilnlm.builder.errors import BuildError
from kilnlm.runtime.engine import Engine
from kilnlm.runtime.errors import EngineError, RequestError
from kilnlm.runtime.manifest import read_manifest

# A packed step mixing two contexts (one chunked), then steps mixing the chunk's rest with generation.
STEPS = [
    [([5, 17, 301, 9, 44, 1200, 7], 0), ([88, 3, 4000], 0), ([12, 13, 14, 15, 16], 0)],
    [([501], 7), ([23], 3), ([48000, 2, 31, 77], 5)],
    [([9], 8), ([64], 4), ([1], 9)],
]


def run_steps(engine: Engine) -> list[torch.Tensor]:
    build = engine.manifest.build
    kv_cache = engine.allocate_kv_cache(len(STEPS[0]) * build.max_blocks_per_seq)
    return [engine.forward(make_engine_inputs(step, build.tokens_per_block, build.max_blocks_per_seq), kv_cache)
            for step in STEPS]


@pytest.fixture(scope="module")
def tiny_tp2_engine_dir(tiny_llama_dir, tmp_path_factory):
    return build_test_engine(tiny_llama_dir, tmp_path_factory.mktemp("engines") / "tiny_fp32_tp2", qformat="fp32",
                             tp_size=2, **TINY_ENGINE_LIMITS)


@pytest.fixture
def tp2_engine(tiny_tp2_engine_dir):
    engine = Engine.load(tiny_tp2_engine_dir)
    yield engine
    engine.close()


def test_tp2_manifest_lists_one_engine_per_rank(tiny_tp2_engine_dir, tiny_engine_dir):
    tp2, tp1 = read_manifest(tiny_tp2_engine_dir), read_manifest(tiny_engine_dir)
    assert tp2.build.tp_size == 2 and tp2.engine_files == ["rank0.pt2", "rank1.pt2"] and tp2.engine_file == "rank0.pt2"
    assert {"all_reduce", "all_gather"} <= set(tp2.plugins) and "all_reduce" not in tp1.plugins
    assert tp2.cache_key_inputs["build"]["tp_size"] == 2 and tp2.cache_key != tp1.cache_key
    assert (tiny_tp2_engine_dir / "rank1.pt2").is_file() and not (tiny_tp2_engine_dir / "model.pt2").exists()


def test_tp2_logits_equal_tp1_on_a_packed_mixed_batch(tp2_engine, tiny_engine_dir):
    tp1 = Engine.load(tiny_engine_dir)
    expected, got = run_steps(tp1), run_steps(tp2_engine)
    for step, (want, have) in enumerate(zip(expected, got)):
        assert have.shape == want.shape == (len(STEPS[step]), tp1.manifest.model.vocab_size)
        torch.testing.assert_close(have, want, rtol=0, atol=1e-5, msg=lambda m: f"step {step}: {m}")


def test_tp2_engine_serves_in_flight_batches_like_tp1(tiny_tp2_engine_dir, tiny_engine_dir):
    from kilnlm.runtime.executor import Executor, ExecutorConfig

    prompts = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10], [400, 500, 600], list(range(100, 140)), [7, 7, 7, 7]]
    max_tokens = [12, 20, 8, 16]
    config = ExecutorConfig(max_batch_size=4, max_num_tokens=24)
    outputs = {}
    for name, engine_dir in (("tp1", tiny_engine_dir), ("tp2", tiny_tp2_engine_dir)):
        with Executor.from_engine_dir(engine_dir, config) as executor:
            outputs[name] = run_in_flight(executor, prompts, max_tokens)
    assert outputs["tp2"] == outputs["tp1"]
    assert [len(o) for o in outputs["tp2"]] == max_tokens


def test_a_killed_rank_fails_the_step_and_every_later_one(tp2_engine):
    build = tp2_engine.manifest.build
    kv_cache = tp2_engine.allocate_kv_cache(build.max_blocks_per_seq)
    inputs = make_engine_inputs([([1, 2, 3], 0)], build.tokens_per_block, build.max_blocks_per_seq)
    tp2_engine.forward(inputs, kv_cache)
    (worker,) = tp2_engine.backend.processes
    os.kill(worker.pid, signal.SIGKILL)
    worker.join(10)
    for _ in range(2):
        with pytest.raises(EngineError, match=r"tensor-parallel rank 1 \(pid \d+\) exited with code -9"):
            tp2_engine.forward(inputs, kv_cache)


def test_a_killed_rank_fails_every_request_and_stops_the_executor(tiny_tp2_engine_dir):
    from kilnlm.runtime.executor import Executor, ExecutorConfig
    from kilnlm.runtime.request import FinishReason, SamplingParams

    with Executor.from_engine_dir(tiny_tp2_engine_dir, ExecutorConfig(max_batch_size=2)) as executor:
        params = SamplingParams(max_tokens=200, ignore_eos=True)
        stream = executor.stream(executor.submit([1, 2, 3], params), timeout_s=60)
        next(stream)  # generating
        queued = executor.submit([4, 5, 6], params)
        (worker,) = executor.engine.backend.processes
        os.kill(worker.pid, signal.SIGKILL)
        finals = [list(stream)[-1], list(executor.stream(queued, timeout_s=60))[-1]]
        for final in finals:
            assert final.finish_reason is FinishReason.ERROR and "tensor-parallel rank 1" in final.error
        assert "tensor-parallel rank 1" in executor.engine_error
        with pytest.raises(EngineError, match="the engine cannot run any more"):
            executor.submit([7, 8], params)
    assert executor.engine.broken is not None and not worker.is_alive()


def test_a_rank_that_died_while_idle_refuses_the_next_request(tiny_tp2_engine_dir):
    """submit checks the engine itself, not only what the loop has recorded: the loop fails a broken
    step's requests before it records the error, and a client that saw them fail must not get a new
    request accepted (this test has no step in flight, so only the engine knows)."""
    from kilnlm.runtime.executor import Executor, ExecutorConfig

    with Executor.from_engine_dir(tiny_tp2_engine_dir, ExecutorConfig(max_batch_size=2)) as executor:
        (worker,) = executor.engine.backend.processes
        os.kill(worker.pid, signal.SIGKILL)
        worker.join(10)
        with pytest.raises(EngineError, match=r"the engine cannot run any more \(tensor-parallel rank 1 \(pid \d+\) exited"):
            executor.submit([7, 8])


def test_a_shut_down_executor_names_the_shutdown_not_its_closed_engine(tiny_tp2_engine_dir):
    from kilnlm.runtime.executor import Executor, ExecutorConfig

    executor = Executor.from_engine_dir(tiny_tp2_engine_dir, ExecutorConfig(max_batch_size=2))
    executor.shutdown()
    assert executor.engine.broken == "the engine was closed"
    with pytest.raises(RequestError, match="the executor is shut down"):
        executor.submit([7, 8])


def test_tp_size_that_does_not_divide_the_heads_is_refused_before_building(tiny_llama_dir, tmp_path):
    with pytest.raises(BuildError, match=r"--tp-size 3 does not divide the model's num_attention_heads \(4\).*--tp-size 1 / 2"):
        build_test_engine(tiny_llama_dir, tmp_path / "out", qformat="fp32", tp_size=3, **TINY_ENGINE_LIMITS)
    assert list(tmp_path.iterdir()) == []


def test_tp_size_is_refused_for_a_target_without_shards(tmp_path):
    from kilnlm.builder.config import BuildOptions, resolve

    with pytest.raises(BuildError, match="--target onnx builds one-rank engines only"):
        resolve(BuildOptions(checkpoint=tmp_path, output=tmp_path / "out", target="onnx", tp_size=2))


# (format, build options, tolerance on the logits against the same format's tp=1 engine). float32
# activations: the shards run tp=1's exact quantized weights and scales, so only the row-parallel sums'
# order differs. fp8 runs bfloat16 activations: each rank's partial sum is rounded to bfloat16 before the
# all-reduce adds them, where tp=1 rounds the whole sum once, and an activation that moves by a bfloat16
# ulp can cross an FP8 rounding boundary (3 mantissa bits: a 1/8 step); measured 0.14 on logits whose
# standard deviation is 0.64, so the bound is 0.25 (the random model's near-ties among 49152 logits can then
# swap its top token, so greedy agreement is checked on SmolLM2, not here).
QUANTIZED_CASES = {
    "int4_awq": (dict(qformat="int4_awq", dtype="float32", group_size=16), 1e-4),
    "int8_sq": (dict(qformat="int8_sq", dtype="float32", per_token=False), 1e-4),
    "fp8": (dict(qformat="fp8"), 0.25),
}


@pytest.mark.parametrize("case", sorted(QUANTIZED_CASES))
def test_quantized_shards_keep_their_scales(case, tiny_llama_dir, tmp_path):
    options, atol = QUANTIZED_CASES[case]
    logits = {}
    for tp_size in (1, 2):
        engine = Engine.load(build_test_engine(tiny_llama_dir, tmp_path / f"tp{tp_size}", tp_size=tp_size,
                                               calib_size=4, **options, **TINY_ENGINE_LIMITS))
        try:
            logits[tp_size] = run_steps(engine)
        finally:
            engine.close()
    for step, (want, have) in enumerate(zip(logits[1], logits[2])):
        torch.testing.assert_close(have, want, rtol=0, atol=atol, msg=lambda m: f"step {step}: {m}")


SMOLLM2_PROMPTS = ["The capital of France is", "Write a short poem about the sea.",
                   "Copy the list: apples, oranges, pears, plums, cherries.", "def add(a, b):\n    return",
                   "Explain what a paged KV cache is."]


def test_smollm2_tp3_greedy_equals_tp1(smollm2_truncated_dir, hf_tokenizer, tmp_path):
    """SmolLM2's first layers (``smollm2_truncated_dir``: its real weights, LM head and vocabulary) split over its
    3 KV heads (3 query heads and 512 MLP columns per rank, 16384 vocabulary rows each): five chat prompts in
    flight give the one-rank engine's greedy completions token for token."""
    from kilnlm.runtime.executor import Executor, ExecutorConfig

    limits = dict(max_batch_size=8, max_seq_len=512, max_num_tokens=512)
    engine_dirs = {f"tp{tp_size}": build_test_engine(smollm2_truncated_dir, tmp_path / f"smollm2_fp32_tp{tp_size}",
                                                     qformat="fp32", tp_size=tp_size, **limits)
                   for tp_size in (1, 3)}
    prompts = [hf_tokenizer.encode(hf_tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                                                   add_generation_prompt=True), add_special_tokens=False)
               for p in SMOLLM2_PROMPTS]
    max_tokens = [24] * len(prompts)
    outputs = {}
    for name, engine_dir in engine_dirs.items():
        with Executor.from_engine_dir(engine_dir, ExecutorConfig(max_batch_size=8)) as executor:
            outputs[name] = run_in_flight(executor, prompts, max_tokens)
    assert outputs["tp3"] == outputs["tp1"] and all(len(o) == 24 for o in outputs["tp1"])
    assert len({tuple(o) for o in outputs["tp1"]}) > 1, "the truncated model answers every prompt alike"


@pytest.mark.triton
@pytest.mark.e2e
def test_triton_serves_a_tp2_engine(tiny_tp2_engine_dir, tiny_engine_dir, tmp_path):
    """tritonserver's tensorrt_llm model loads the tp=2 engine (its rank 1 a process of the model's own) and
    answers tritonclient's /infer with tp=1's greedy tokens."""
    import numpy as np
    from servers import running_tritonserver

    from kilnlm.runtime.executor import Executor, ExecutorConfig
    from kilnlm.runtime.request import SamplingParams

    httpclient = pytest.importorskip("tritonclient.http")
    prompt_ids, max_tokens = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10], 12
    with Executor.from_engine_dir(tiny_engine_dir, ExecutorConfig(max_batch_size=2)) as executor:
        expected = executor.generate(prompt_ids, SamplingParams(max_tokens=max_tokens), timeout_s=120)
    with running_tritonserver(tmp_path, engine_dir=tiny_tp2_engine_dir, decoupled_mode=False) as server:
        inputs = []
        for name, value in (("input_ids", [prompt_ids]), ("input_lengths", [[len(prompt_ids)]]),
                            ("request_output_len", [[max_tokens]]), ("exclude_input_in_output", [[True]])):
            array = np.array(value, dtype=bool if name == "exclude_input_in_output" else np.int32)
            inputs.append(httpclient.InferInput(name, list(array.shape), "BOOL" if array.dtype == bool else "INT32"))
            inputs[-1].set_data_from_numpy(array)
        client = httpclient.InferenceServerClient(server.http_url.removeprefix("http://"))
        result = client.infer("tensorrt_llm", inputs)
    assert len(expected.token_ids) > 1
    assert result.as_numpy("output_ids").tolist() == [[expected.token_ids]]


def test_launcher_world_size_must_be_the_engines_tp_size(tiny_tp2_engine_dir, launcher, capsys):
    """TensorRT-LLM's ``launch_triton_server.py --world_size N``, checked against the engine before anything starts."""
    launcher.check_world_size(tiny_tp2_engine_dir, 2)
    assert launcher.main(["--engine", str(tiny_tp2_engine_dir), "--world_size", "4"]) == 2
    assert re.search(r"--world-size 4 but \S+ was built with --tp-size 2", capsys.readouterr().err)


@pytest.mark.e2e
def test_kilnlm_serve_exits_when_a_rank_dies(tiny_tp2_engine_dir, tmp_path):
    """``kilnlm serve`` of a tp=2 engine answers the openai client; once its rank 1 is killed, the server
    exits with status 1 saying which rank died (rather than serving errors forever)."""
    import time

    openai = pytest.importorskip("openai")
    from servers import running_kilnlm_serve

    with running_kilnlm_serve(["--engine", str(tiny_tp2_engine_dir)], tmp_path) as served:
        client = openai.OpenAI(base_url=f"{served.url}/v1", api_key="unused")
        completion = client.completions.create(model="tiny_fp32_tp2", prompt="Hello", max_tokens=4)
        assert completion.choices[0].text
        children = (Path("/proc") / str(served.process.pid) / "task" / str(served.process.pid) / "children").read_text()
        (rank1,) = [int(pid) for pid in children.split() if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes()]
        os.kill(rank1, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while served.process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert served.process.returncode == 1
    assert re.search(r"the engine cannot run any more \(tensor-parallel rank 1 \(pid \d+\) exited", served.log_path.read_text())


# ---------------------------------------------------------------------------------------------------------
# Ranks started by a launcher (torchrun): two "hosts" on loopback, each with its own copy of the engine.

LAUNCH_ENV = {"OMP_NUM_THREADS": "1"}  # two ranks on this machine's cores


def host_copies(engine_dir: Path, tmp_path: Path) -> list[Path]:
    """The engine directory as two hosts would hold it: a copy each."""
    import shutil

    return [Path(shutil.copytree(engine_dir, tmp_path / f"host{host}" / engine_dir.name)) for host in (0, 1)]


def launch_two_hosts(command: list[str], engine_dirs: list[Path]) -> list:
    """``torchrun`` of ``command --engine DIR`` for hosts 0 and 1 (each its own engine copy), run to the end;
    their CompletedProcess-like results in host order."""
    import subprocess

    from servers import free_port, torchrun

    port = free_port()
    processes = [subprocess.Popen([*torchrun(2, host, port), *command, "--engine", str(engine_dir)], text=True,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**os.environ, **LAUNCH_ENV})
                 for host, engine_dir in enumerate(engine_dirs)]
    results = []
    for process in processes:
        try:
            stdout, stderr = process.communicate(timeout=180)
        except subprocess.TimeoutExpired:
            for p in processes:
                p.kill()
            raise
        results.append(subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr))
    return results


@pytest.mark.e2e
def test_torchrun_across_two_hosts_generates_tp1s_completion(tiny_tp2_engine_dir, tiny_engine_dir, tmp_path):
    """``torchrun --nnodes 2 ... kilnlm generate`` of a tp=2 engine: rank 0 prints tp=1's greedy completion,
    rank 1 serves it and exits 0 when rank 0 closes the engine."""
    import subprocess

    from servers import venv_executable

    generate = [venv_executable("kilnlm"), "generate", "--max-tokens", "12", "--ignore-eos", "Hello there"]
    expected = subprocess.run([*generate, "--engine", str(tiny_engine_dir)], capture_output=True, text=True, check=True)
    host0, host1 = launch_two_hosts(generate, host_copies(tiny_tp2_engine_dir, tmp_path))
    assert host0.returncode == 0 and host1.returncode == 0, host0.stderr[-3000:] + host1.stderr[-3000:]
    assert host0.stdout == expected.stdout and expected.stdout.strip()
    assert host1.stdout == ""


def test_launched_ranks_refuse_different_manifests(tiny_tp2_engine_dir, tmp_path):
    """Each host verifies its own copy; copies whose manifests differ (here by one byte, still valid) are
    refused on both hosts, naming the rank, before any request."""
    from servers import venv_executable

    copies = host_copies(tiny_tp2_engine_dir, tmp_path)
    with open(copies[1] / "manifest.json", "a") as manifest:
        manifest.write("\n")
    host0, host1 = launch_two_hosts([venv_executable("kilnlm"), "generate", "Hello"], copies)
    assert host0.returncode != 0 and host1.returncode != 0 and host0.stdout == ""
    assert "rank 1's manifest.json is not rank 0's" in host0.stderr


def test_a_launch_of_another_world_size_is_refused(tiny_tp2_engine_dir, monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "1")  # never reached: refused before joining
    with pytest.raises(EngineError, match=r"launched as one of WORLD_SIZE=3 ranks, but \S+ has tp_size 2"):
        Engine.load(tiny_tp2_engine_dir)


@pytest.mark.e2e
def test_kilnlm_serve_across_two_hosts_exits_when_the_other_hosts_rank_dies(tiny_tp2_engine_dir, tmp_path):
    """``kilnlm serve`` under torchrun on two hosts answers the openai client from host 0; once host 1's rank
    is killed, the next request gets an error, host 0's server exits with status 1 and both torchruns end."""
    import subprocess
    import time

    openai = pytest.importorskip("openai")
    from servers import free_port, running_kilnlm_serve, stop_process, torchrun, venv_executable

    copies = host_copies(tiny_tp2_engine_dir, tmp_path)
    port = free_port()
    host1 = subprocess.Popen([*torchrun(2, 1, port), venv_executable("kilnlm"), "serve", "--engine", str(copies[1]),
                              "--port", str(free_port())], env={**os.environ, **LAUNCH_ENV},
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        with running_kilnlm_serve(["--engine", str(copies[0])], tmp_path, env=LAUNCH_ENV,
                                  launch=torchrun(2, 0, port)) as served:
            client = openai.OpenAI(base_url=f"{served.url}/v1", api_key="unused", max_retries=0)
            assert client.completions.create(model="tiny_fp32_tp2", prompt="Hello", max_tokens=4).choices[0].text
            children = (Path("/proc") / str(host1.pid) / "task" / str(host1.pid) / "children").read_text()
            (rank1,) = [int(pid) for pid in children.split()]
            assert b"RANK=1\0" in Path(f"/proc/{rank1}/environ").read_bytes()
            os.kill(rank1, signal.SIGKILL)
            with pytest.raises(openai.APIError):
                client.completions.create(model="tiny_fp32_tp2", prompt="Hello", max_tokens=4)
            deadline = time.monotonic() + 30
            while served.process.poll() is None and time.monotonic() < deadline:
                time.sleep(0.2)
            assert served.process.returncode not in (None, 0)
        assert host1.wait(30) != 0
    finally:
        stop_process(host1)
    assert re.search(r"the engine cannot run any more \(a tensor-parallel (rank stopped taking commands|collective "
                     r"failed)", served.log_path.read_text())


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_a_vocabulary_tp_size_does_not_divide_is_padded_on_the_last_rank(tied, smollm2_hf_dir, tmp_path):
    """vocab 49155 at tp=2: rank 0 holds 24578 rows, rank 1 24577 and one padding row that the all-gather
    drops; the logits (all 49155 columns) and the embedding of the last rank's ids equal tp=1's."""
    from factories import make_tiny_checkpoint

    checkpoint = make_tiny_checkpoint(tmp_path / "checkpoint", smollm2_hf_dir, "llama", vocab_size=49155,
                                      tie_word_embeddings=tied)
    engines = [Engine.load(build_test_engine(checkpoint, tmp_path / f"tp{tp_size}", qformat="fp32", tp_size=tp_size,
                                             **TINY_ENGINE_LIMITS)) for tp_size in (1, 2)]
    steps = [[([49154, 24578, 24577, 3], 0), ([49153, 2], 0)], [([0], 4), ([49154], 2)]]
    try:
        logits = []
        for engine in engines:
            build = engine.manifest.build
            kv_cache = engine.allocate_kv_cache(len(steps[0]) * build.max_blocks_per_seq)
            logits.append([engine.forward(make_engine_inputs(step, build.tokens_per_block, build.max_blocks_per_seq),
                                          kv_cache) for step in steps])
    finally:
        for engine in engines:
            engine.close()
    for want, have in zip(*logits):
        assert have.shape == want.shape and want.shape[-1] == 49155
        torch.testing.assert_close(have, want, rtol=0, atol=1e-5)
