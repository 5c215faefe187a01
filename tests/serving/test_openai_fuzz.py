"""Property-based fuzzing (hypothesis) of the OpenAI-compatible front, over real HTTP to uvicorn serving the
tiny compiled engine: requests of wrong types, missing and unknown fields, hostile numbers, unknown models,
wrong API keys, and bodies that are not JSON or not UTF-8. Every one gets a 2xx (and then a complete reply)
or a 4xx with OpenAI's error JSON, never a 5xx; the server stays up and no KV block stays held after any
reply. A fixed example budget with derandomized generation, so CI runs the same cases every time."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request

import pytest
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st
from servers import all_blocks_free, running_openai_server

from kilnlm.runtime.executor import Executor, ExecutorConfig
from kilnlm.runtime.serving.openai_server import ServerSettings

MODEL = "tiny"
API_KEY = "fuzz-key"
EXAMPLES = 120  # per endpoint; ~0.1 s each on the tiny engine
FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow])
FIELDS = ["model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "n",
          "best_of", "stream", "stream_options", "stop", "seed", "logprobs", "top_logprobs", "presence_penalty",
          "frequency_penalty", "repetition_penalty", "min_tokens", "ignore_eos", "response_format", "echo",
          "logit_bias", "user", "suffix", "tools", "tool_choice"]
HOSTILE_NUMBERS = [-1, 0, 1, 2**31, 2**63 - 1, 2**64, 10**30, -(10**30), 1e308, -1e308, -0.0, 1e-320, 0.5, 2.5]

json_leaf = (st.none() | st.booleans() | st.integers(min_value=-(2**70), max_value=2**70) | st.sampled_from(HOSTILE_NUMBERS)
             | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=24))
json_value = st.recursive(json_leaf, lambda children: st.lists(children, max_size=5)
                          | st.dictionaries(st.text(max_size=10), children, max_size=4), max_leaves=12)
messages = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "tool", "x"]),
                                           "content": st.text(max_size=40) | json_value}), max_size=4)
overrides = st.dictionaries(st.sampled_from(FIELDS) | st.text(max_size=12), json_value | messages, max_size=5)


@pytest.fixture(scope="module")
def fuzzed(tiny_engine_dir):
    """(base URL, executor): the tiny engine's executor behind kilnlm's OpenAI server, with an API key."""
    executor = Executor.from_engine_dir(tiny_engine_dir, ExecutorConfig())
    with running_openai_server(executor, ServerSettings(MODEL, api_key=API_KEY)) as url:
        yield url, executor
    executor.shutdown()


def post(url: str, path: str, body: bytes, api_key: str | None = API_KEY) -> tuple[int, bytes]:
    headers = {"Content-Type": "application/json"} | ({"Authorization": f"Bearer {api_key}"} if api_key else {})
    request = urllib.request.Request(f"{url}{path}", data=body, method="POST", headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=120) as reply:
            return reply.status, reply.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def check_reply(fuzzed, status: int, body: bytes, sent: bytes) -> None:
    """A 2xx with a complete reply (a JSON object, or an SSE stream ending in [DONE]) or a 4xx with OpenAI's
    error object; then the executor holds no request and no KV block, and /health answers."""
    url, executor = fuzzed
    event(f"HTTP {status}")  # pytest --hypothesis-show-statistics: how the cases spread over outcomes
    assert status < 500, (status, body[:500], sent[:500])
    if status >= 400:
        error = json.loads(body)["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"], (status, error, sent[:500])
    elif body.startswith(b"data:"):
        assert body.rstrip().endswith(b"data: [DONE]"), (body[-300:], sent[:500])
    else:
        assert isinstance(json.loads(body), dict), body[:300]
    deadline = time.monotonic() + 30
    while not all_blocks_free(executor):
        assert time.monotonic() < deadline, (f"KV blocks or requests still held after the reply: {executor.stats()}",
                                             sent[:500])
        time.sleep(0.01)
    with urllib.request.urlopen(f"{url}/health", timeout=10) as reply:
        assert reply.status == 200


@pytest.mark.parametrize("path,base", [
    ("/v1/completions", {"model": MODEL, "prompt": "The kiln", "max_tokens": 4}),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}),
], ids=["completions", "chat"])
@FUZZ
@given(changes=overrides, drop=st.sets(st.sampled_from(["model", "prompt", "messages", "max_tokens"])),
       api_key=st.sampled_from([API_KEY] * 6 + [None, "wrong-key"]))
@example(changes={"n": 100_000}, drop=set(), api_key=API_KEY)  # once accepted: minutes of work for one request
@example(changes={"n": 2**63 - 1, "max_tokens": 2**63 - 1}, drop=set(), api_key=API_KEY)
@example(changes={"stop": ["s"] * 5000}, drop=set(), api_key=API_KEY)
@example(changes={"model": "other"}, drop=set(), api_key=API_KEY)
def test_json_requests_get_a_reply_or_an_openai_error(fuzzed, path, base, changes, drop, api_key):
    body = {k: v for k, v in base.items() if k not in drop} | changes
    sent = json.dumps(body).encode()
    status, reply = post(fuzzed[0], path, sent, api_key)
    if api_key != API_KEY:
        assert status == 401, (status, reply[:300])
    check_reply(fuzzed, status, reply, sent)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@FUZZ
@given(raw=st.binary(max_size=200) | st.sampled_from([
    b"", b"{", b"[]", b"null", b'"text"', b"\xff\xfe{}", b'{"model": "tiny", "prompt": "\xc3\x28"}',
    b'{"model": "tiny", "prompt": "x", "temperature": NaN}', b'{"model": "tiny", "prompt": "x", "top_p": Infinity}',
    b'{"model": "tiny", "prompt": "x", "max_tokens": -Infinity}', b'{"model": "tiny", "prompt": "x", "n": 1e999}',
    b'{"model": "tiny", "messages": [{"role": "user", "content": "' + b"a" * 100_000 + b'"}]}',
]))
def test_bodies_that_are_not_json_requests_get_an_openai_error(fuzzed, path, raw):
    status, reply = post(fuzzed[0], path, raw)
    check_reply(fuzzed, status, reply, raw)
