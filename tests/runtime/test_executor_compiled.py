"""The executor on compiled (AOTInductor) engines built by the builder's session fixtures: greedy output
of in-flight batched requests equals transformers' ``generate`` greedy output.

Several prompts of different lengths and different ``max_tokens`` are submitted together, more join while
the first ones decode, and the long prompt's context phase is chunked (``max_num_tokens`` lowered)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

from factories import CAPITAL_QUESTION, hf_greedy, make_engine_inputs, reference_penalised, run_in_flight

from kilnlm.builder.targets.cpu import example_inputs
from kilnlm.runtime.abi import EngineInputs
from kilnlm.runtime.engine import Engine
from kilnlm.runtime.executor import Executor, ExecutorConfig
from kilnlm.runtime.request import FinishReason, SamplingParams

PROMPTS = [
    "The capital of France is",
    "Write a short poem about the sea.",
    "def fibonacci(n):\n",
    "List three colours:",
    "Hi",
    "Explain in one paragraph why the sky is blue, mentioning Rayleigh scattering, the wavelength of light "
    "and the composition of the atmosphere, as if to a curious ten-year-old who asked at dinner",
]
MAX_TOKENS = [32, 24, 32, 9, 32, 28]


def check_engine(engine_dir, hf_dir, config: ExecutorConfig, chat: bool) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    with Executor.from_engine_dir(engine_dir, config) as executor:
        tok = executor.tokenizer
        if chat:
            prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": p}]), add_special_tokens=False)
                       for p in PROMPTS]
        else:
            prompts = [tok.encode(p) for p in PROMPTS]
        expected = [hf_greedy(model, p, n) for p, n in zip(prompts, MAX_TOKENS)]
        outputs = run_in_flight(executor, prompts, MAX_TOKENS)
        again = run_in_flight(executor, prompts, MAX_TOKENS)  # prefix-cache hits this time
        texts = [tok.decode(o) for o in outputs]
        stats = executor.stats()
    for i, (got, want) in enumerate(zip(outputs, expected)):
        assert got == want, f"prompt {i} {PROMPTS[i]!r}: kilnlm {got} != transformers {want}"
    assert again == expected
    assert stats.num_free_blocks == stats.num_total_blocks and stats.num_cached_blocks > 0
    assert all(texts)


def test_tiny_engine_in_flight_greedy_equals_transformers(tiny_engine_dir, tiny_llama_dir):
    check_engine(tiny_engine_dir, tiny_llama_dir, ExecutorConfig(max_batch_size=4, max_num_tokens=24), chat=False)


@pytest.mark.e2e
def test_smollm2_fp32_in_flight_greedy_equals_transformers(smollm2_engine_fp32_dir, smollm2_hf_dir):
    # A small pool (64 blocks) instead of the default: the SmolLM2 fp32 KV cache is 45 KiB per token.
    from kilnlm.runtime.abi import kv_cache_shape
    from kilnlm.runtime.manifest import read_manifest

    manifest = read_manifest(smollm2_engine_fp32_dir)
    m = manifest.model
    bytes_per_block = 4 * torch.Size(kv_cache_shape(m.num_layers, 1, manifest.build.tokens_per_block, m.num_kv_heads, m.head_dim)).numel()
    config = ExecutorConfig(kv_cache_bytes=64 * bytes_per_block, max_batch_size=4, max_num_tokens=48)
    check_engine(smollm2_engine_fp32_dir, smollm2_hf_dir, config, chat=True)


@pytest.mark.e2e
def test_smollm2_stop_string_and_chat_answer(smollm2_engine_fp32_dir):
    with Executor.from_engine_dir(smollm2_engine_fp32_dir, ExecutorConfig(max_batch_size=2)) as executor:
        tok = executor.tokenizer
        prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": CAPITAL_QUESTION}]),
                            add_special_tokens=False)
        full = executor.generate(prompt, SamplingParams(max_tokens=48))
        assert "Paris" in full.text
        assert full.finish_reason in (FinishReason.END_ID, FinishReason.LENGTH)
        stopped = executor.generate(prompt, SamplingParams(max_tokens=48, stop=["Paris"]))
    assert stopped.finish_reason is FinishReason.STOP
    assert stopped.text == full.text[: full.text.index("Paris")]


def test_tiny_engine_log_probs_are_log_softmax_of_its_logits(tiny_engine_dir):
    """Log-probs of a sampled, penalised request equal ``log_softmax`` of the engine's raw logits of each step,
    recomputed here by decoding the returned tokens one forward at a time through the same engine."""
    params = SamplingParams(max_tokens=12, logprobs=5, temperature=0.8, seed=3, repetition_penalty=1.3, ignore_eos=True)
    with Executor.from_engine_dir(tiny_engine_dir, ExecutorConfig(max_batch_size=4)) as executor:
        prompt = executor.tokenizer.encode("The capital of France is")
        response = executor.generate(prompt, params, timeout_s=120)
    assert len(response.token_ids) == len(response.log_probs) == len(response.top_logprobs) == 12

    engine = Engine.load(tiny_engine_dir)
    build = engine.manifest.build
    kv_cache = engine.allocate_kv_cache(build.max_blocks_per_seq)
    new_ids, num_cached = list(prompt), 0
    for step, token in enumerate(response.token_ids):
        inputs = make_engine_inputs([(new_ids, num_cached)], build.tokens_per_block, build.max_blocks_per_seq)
        logprobs = engine.forward(inputs, kv_cache)[0].log_softmax(-1)
        assert response.log_probs[step] == pytest.approx(float(logprobs[token]), abs=1e-4)
        values, ids = logprobs.topk(5)
        assert list(response.top_logprobs[step]) == ids.tolist()
        assert list(response.top_logprobs[step].values()) == pytest.approx(values.tolist(), abs=1e-4)
        num_cached += len(new_ids)
        new_ids = [token]
    assert response.cum_log_prob == pytest.approx(sum(response.log_probs), abs=1e-4)


def test_tiny_engine_penalties_and_min_tokens_equal_a_plain_torch_loop(tiny_engine_dir):
    """Greedy decoding with the three penalties and min_tokens through the executor equals decoding the
    engine's logits here with the penalties written as loops and the end id banned below min_tokens."""
    engine = Engine.load(tiny_engine_dir)
    build = engine.manifest.build

    def reference(prompt: list[int], params: SamplingParams) -> list[int]:
        kv_cache = engine.allocate_kv_cache(build.max_blocks_per_seq)
        tokens, new_ids = list(prompt), list(prompt)
        for _ in range(params.max_tokens):
            inputs = make_engine_inputs([(new_ids, len(tokens) - len(new_ids))], build.tokens_per_block, build.max_blocks_per_seq)
            logits = reference_penalised(engine.forward(inputs, kv_cache), [tokens], [len(prompt)], [params])[0]
            if params.end_id is not None and len(tokens) - len(prompt) < params.min_tokens:
                logits[params.end_id] = float("-inf")
            token = int(logits.argmax())
            if token == params.end_id:
                break
            tokens.append(token)
            new_ids = [token]
        return tokens[len(prompt):]

    with Executor.from_engine_dir(tiny_engine_dir, ExecutorConfig(max_batch_size=4)) as executor:
        prompt = executor.tokenizer.encode("the the the cat sat on the mat and the")
        plain = executor.generate(prompt, SamplingParams(max_tokens=12, ignore_eos=True)).token_ids
        cases = [SamplingParams(max_tokens=12, ignore_eos=True, repetition_penalty=1.8),
                 SamplingParams(max_tokens=12, ignore_eos=True, presence_penalty=1.5, frequency_penalty=0.7),
                 SamplingParams(max_tokens=12, ignore_eos=True, repetition_penalty=0.7, frequency_penalty=-0.5),
                 # the first plain token as the end id: without min_tokens the output would be empty
                 SamplingParams(max_tokens=12, end_id=plain[0], min_tokens=6)]
        outputs = [executor.generate(prompt, params).token_ids for params in cases]
    for params, got in zip(cases, outputs):
        assert got == reference(prompt, params), params
    assert all(output != plain for output in outputs[:3])  # each penalty changed the output
    assert len(outputs[3]) >= 6 and plain[0] not in outputs[3][:6]


def test_generate_cli_on_the_tiny_engine(tiny_engine_dir, tiny_llama_dir, capsys):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kilnlm.cli.main import main

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    hf_tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    prompt = "In-flight batching means"
    ids = hf_tokenizer(prompt).input_ids
    expected = hf_tokenizer.decode(hf_greedy(model, ids, 10), skip_special_tokens=True)
    assert main(["generate", "--engine", str(tiny_engine_dir), "--max-tokens", "10", prompt]) == 0
    out = capsys.readouterr().out
    # The CLI stops at EOS where transformers (min_new_tokens) does not: compare up to the CLI's length.
    assert out.endswith("\n") and expected.startswith(out[:-1]) and out[:-1]


def test_engine_forward_releases_the_gil(tiny_engine_dir):
    """Another Python thread runs while the compiled forward runs (kilnlm.runtime.backends.cpu.load_package), and
    the logits equal those of torch's own runner (which holds the GIL)."""
    engine = Engine.load(tiny_engine_dir)
    *tensors, kv_cache = example_inputs(engine.manifest.model, engine.manifest.build, engine.dtype)
    inputs = EngineInputs(*tensors)
    reference = torch._inductor.aoti_load_package(str(tiny_engine_dir / engine.manifest.engine_file))
    expected = reference(*inputs.as_args(kv_cache.clone()))
    torch.testing.assert_close(engine.forward(inputs, kv_cache.clone()), expected, rtol=0, atol=0)

    counted, stop = [0], threading.Event()

    def count() -> None:  # takes the GIL whenever it is free, and gives it back at once (sleep(0))
        while not stop.is_set():
            counted[0] += 1
            time.sleep(0)

    # With preemption of the GIL holder pushed out of reach, this thread lets go of the GIL only inside
    # forward(): the counter can then move only if forward() releases it.
    switch_interval = sys.getswitchinterval()
    sys.setswitchinterval(100.0)
    thread = threading.Thread(target=count)
    thread.start()
    try:
        time.sleep(0.01)  # let the counter start
        start = counted[0]
        for _ in range(50):
            engine.forward(inputs, kv_cache)
        advanced = counted[0] - start
    finally:
        stop.set()
        thread.join()
        sys.setswitchinterval(switch_interval)
    assert advanced > 0


LOAD_THEN_WAIT = """
import sys, torch
from kilnlm.builder.targets.cpu import example_inputs
from kilnlm.runtime.abi import EngineInputs
from kilnlm.runtime.engine import Engine
engine = Engine.load(sys.argv[1])
*tensors, kv_cache = example_inputs(engine.manifest.model, engine.manifest.build, engine.dtype)
engine.forward(EngineInputs(*tensors), kv_cache)
print("served", flush=True)
sys.stdin.read()
"""


def test_a_loaded_engine_leaves_nothing_in_the_temporary_directory_even_when_killed(tiny_engine_dir, tmp_path):
    """The package is extracted, loaded and its extraction removed before the first forward
    (kilnlm.runtime.backends.cpu.load_package): a process killed with SIGKILL while serving leaves no
    extracted engine in $TMPDIR. torch's own loader left one per killed process (0.5 GB for SmolLM2 fp32)."""
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    process = subprocess.Popen([sys.executable, "-c", LOAD_THEN_WAIT, str(tiny_engine_dir)], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, text=True, env={**os.environ, "TMPDIR": str(tmpdir)})
    try:
        assert process.stdout.readline() == "served\n"
        assert sorted(os.listdir(tmpdir)) == []
    finally:
        process.send_signal(signal.SIGKILL)
        process.wait(timeout=30)
    assert sorted(os.listdir(tmpdir)) == []


def test_the_tokenizer_parses_during_the_package_load(tiny_engine_dir, monkeypatch):
    """The CPU backend calls ``while_loading`` once, after the package's extraction and just before torch's
    loader (the longest call of the load that releases the GIL), and the executor parses its tokenizer only
    from then on; with a backend that never calls it, the executor still gets its tokenizer."""
    import kilnlm.plugins.cpu as plugins_cpu
    from kilnlm.runtime.backends.cpu import CpuBackend
    from kilnlm.runtime.tokenizer import Tokenizer

    events = []
    load_aoti_package, from_dir = plugins_cpu.load_aoti_package, Tokenizer.from_dir.__func__
    load_verified = Engine.load_verified.__func__

    def recording_load_verified(cls, engine_dir, manifest, while_loading=None):
        def called():
            events.append("while_loading")
            while_loading()
        return load_verified(cls, engine_dir, manifest, while_loading=called)

    monkeypatch.setattr(plugins_cpu, "load_aoti_package", lambda path: events.append("package") or load_aoti_package(path))
    monkeypatch.setattr(Tokenizer, "from_dir", classmethod(lambda cls, d: events.append("tokenizer") or from_dir(cls, d)))
    monkeypatch.setattr(Engine, "load_verified", classmethod(recording_load_verified))
    with Executor.from_engine_dir(tiny_engine_dir, ExecutorConfig(max_batch_size=1)) as executor:
        assert executor.generate([1, 2, 3], SamplingParams(max_tokens=2, ignore_eos=True), timeout_s=120).token_ids
    assert events[0] == "while_loading" and sorted(events[1:]) == ["package", "tokenizer"]

    events.clear()
    cpu_load = CpuBackend.load.__func__
    monkeypatch.setattr(CpuBackend, "load", classmethod(lambda cls, d, m, rank=0, while_loading=None: cpu_load(cls, d, m, rank)))
    with Executor.from_engine_dir(tiny_engine_dir, ExecutorConfig(max_batch_size=1)) as executor:
        assert executor.tokenizer.encode("the cat")
    assert sorted(events) == ["package", "tokenizer"]
