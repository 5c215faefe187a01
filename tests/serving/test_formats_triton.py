"""Every quantization format still answers ``CAPITAL_QUESTION`` (tests/factories.py) with Paris through a real
tritonserver (issue 3, item 10).

One tritonserver serves one LLM model per format (``kilnlm_<qformat>`` and ``kilnlm_fp8_kv_<dtype>`` for
the 8-bit KV caches), each a copy of ``model_repository/tensorrt_llm`` pointed at that format's SmolLM2
engine (built once per session by the ``smollm2_format_engine`` factory of tests/conftest.py) with a small
KV pool, so the whole set fits in memory at once. The fp32 engine is covered by tests/serving/test_triton.py.
The question, in the chat template and tokenized here as TensorRT-LLM's clients of its ``tensorrt_llm``
model do, goes through Triton's HTTP ``generate`` endpoint, greedy.
Every format listed must build and serve: one the builder does not offer, or that fails to build or to
load, fails the test (only a machine without tritonserver skips). The answers need an engine of every format
and carry the ``quality`` marker (``bash scripts/test.sh -m quality``).
"""

from __future__ import annotations

import json
import re
import shutil
import urllib.request
from pathlib import Path

import pytest
from factories import CAPITAL_QUESTION
from servers import running_tritonserver

pytestmark = [pytest.mark.triton, pytest.mark.e2e]

# model name -> (qformat, kv_cache_dtype)
FORMATS = {
    "kilnlm_fp8": ("fp8", "auto"),
    "kilnlm_fp8_rowwise": ("fp8_rowwise", "auto"),
    "kilnlm_int8_sq": ("int8_sq", "auto"),
    "kilnlm_int8_wo": ("int8_wo", "auto"),
    "kilnlm_int4_awq": ("int4_awq", "auto"),
    "kilnlm_int4_wo": ("int4_wo", "auto"),
    "kilnlm_fp8_kv_fp8": ("fp8", "fp8"),
    "kilnlm_fp8_kv_int8": ("fp8", "int8"),
}
KV_CACHE_BYTES = 64 << 20  # per model: ~2,000 tokens of SmolLM2 bf16 KV, plenty for one question
START_TIMEOUT_S = 600.0  # eight models, one engine each, load one after another
_ENGINE_DIR_RE = re.compile(r'(key:\s*"engine_dir"\s*value:\s*\{\s*string_value:\s*)"[^"]*"', re.S)


def write_model(template: Path, repository: Path, name: str, engine_dir: Path) -> None:
    """``repository/name``: a copy of the template's ``tensorrt_llm`` model named ``name``, serving ``engine_dir``."""
    source = template / "tensorrt_llm"
    dest = repository / name
    shutil.copytree(source, dest, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    text = (dest / "config.pbtxt").read_text()
    text, num_names = re.subn(r'^name:\s*"tensorrt_llm"', f'name: "{name}"', text, flags=re.M)
    text, num_dirs = _ENGINE_DIR_RE.subn(lambda m: f'{m.group(1)}"{engine_dir.resolve()}"', text)
    assert num_names == 1 and num_dirs == 1, "model_repository/tensorrt_llm/config.pbtxt changed shape: update this test"
    text += f'\nparameters: {{\n  key: "kv_cache_bytes"\n  value: {{ string_value: "{KV_CACHE_BYTES}" }}\n}}\n'
    (dest / "config.pbtxt").write_text(text)


@pytest.fixture(scope="module")
def formats_server(smollm2_format_engine, tmp_path_factory):
    """The HTTP URL of the server with every format of FORMATS. A format whose engine is not built (the
    builder does not offer it) fails here: a missing format is a failure, not a skip."""
    engines = {}
    for name, (qformat, kv_cache_dtype) in FORMATS.items():
        try:
            engines[name] = smollm2_format_engine(qformat, kv_cache_dtype)
        except pytest.skip.Exception as exc:
            pytest.fail(f"{name} (--qformat {qformat}, --kv-cache-dtype {kv_cache_dtype}) was not built: {exc}")
    def one_model_per_format(template: Path, repository: Path) -> None:
        shutil.rmtree(repository)
        repository.mkdir()
        for name, engine_dir in engines.items():
            write_model(template, repository, name, engine_dir)

    with running_tritonserver(tmp_path_factory.mktemp("triton_formats"), engine_dir=next(iter(engines.values())),
                              edit_repository=one_model_per_format, start_timeout_s=START_TIMEOUT_S) as server:
        yield server.http_url


# Engines that answer wrongly today (greedy). Strict: a correct answer fails here until the marker is
# removed. None since 2026-11-22: int8_sq answered "The capital of France is France." while it calibrated on
# the Python language reference alone, whose activations never reach the range factual recall produces in
# the down projections; with kilnlm's general English text in the default calibration it answers Paris
# (docs/quantization.md).
KNOWN_WRONG: dict[str, str] = {}


def test_every_quantized_format_is_served():
    """A format added to the registry joins FORMATS, so that it is asked the question too."""
    from kilnlm.builder.formats import Quantization, format_names

    assert {qformat for qformat, _ in FORMATS.values()} == set(format_names(lambda f: f.quantization is not Quantization.NONE))


@pytest.mark.quality  # one whole-SmolLM2 engine per format (tests/conftest.py, SMOLLM2_CI_ENGINES)
@pytest.mark.parametrize("model", [
    pytest.param(m, marks=pytest.mark.xfail(strict=True, reason=KNOWN_WRONG[m])) if m in KNOWN_WRONG else m
    for m in FORMATS
])
def test_format_answers_paris(formats_server, smollm2_engine_fp32_dir, model):
    from kilnlm.runtime.tokenizer import Tokenizer

    http_url = formats_server
    tokenizer = Tokenizer.from_dir(smollm2_engine_fp32_dir / "tokenizer")  # every format's tokenizer is SmolLM2's
    prompt_ids = tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": CAPITAL_QUESTION}]),
                                  add_special_tokens=False)
    body = {"input_ids": prompt_ids, "input_lengths": len(prompt_ids), "request_output_len": 24,
            "exclude_input_in_output": True}
    request = urllib.request.Request(f"{http_url}/v2/models/{model}/generate", data=json.dumps(body).encode(),
                                     method="POST", headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=180) as reply:
        answer = json.loads(reply.read().decode("utf-8"))
    text = tokenizer.decode(answer["output_ids"])
    print(f"\n[formats] {model}: {text!r}")
    assert "Paris" in text, f"{model} answered {text!r}"
