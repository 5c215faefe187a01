"""kilnlm.runtime.serving.triton_backend against a stand-in ``triton_python_backend_utils``: the serving
package imports without Triton, and the glue maps replies, errors, flags and metric kinds as Triton wants."""

from __future__ import annotations

import gc
import subprocess
import sys
import types

import numpy as np

from kilnlm.runtime.serving import triton_backend
from kilnlm.runtime.serving.metrics import Metrics
from kilnlm.runtime.serving.responses import ErrorKind, Reply

FINAL = 1 << 0


class TritonError:
    INTERNAL, INVALID_ARG, UNAVAILABLE = "INTERNAL", "INVALID_ARG", "UNAVAILABLE"

    def __init__(self, message, code=INTERNAL):
        self._message, self._code = message, code

    def message(self):
        return self._message

    def code(self):
        return self._code


class Tensor:
    def __init__(self, name, array):
        self.name, self.array = name, np.asarray(array)

    def as_numpy(self):
        return self.array


class InferenceResponse:
    def __init__(self, output_tensors, error=None):
        self._tensors, self._error = output_tensors, error

    def output_tensors(self):
        return self._tensors

    def has_error(self):
        return self._error is not None

    def error(self):
        return self._error


class MetricFamily:
    GAUGE, COUNTER, HISTOGRAM = "GAUGE", "COUNTER", "HISTOGRAM"
    created: list = []
    deleted: list = []  # Triton's metrics stop working once their family object is deleted

    def __init__(self, name, description, kind):
        self.name, self.kind = name, kind

    def __del__(self):
        MetricFamily.deleted.append(self.name)

    def Metric(self, labels, **kwargs):  # noqa: N802 (Triton's name)
        MetricFamily.created.append((self.name, self.kind, labels, kwargs))
        return types.SimpleNamespace(set=lambda v: None, increment=lambda v: None, observe=lambda v: None)


def fake_pb_utils(bls_responses=()):
    requests = []

    class InferenceRequest:
        def __init__(self, model_name, inputs, requested_output_names):
            requests.append((model_name, {t.name: t.array.tolist() for t in inputs}, requested_output_names))

        def exec(self, decoupled):
            assert decoupled
            return iter(bls_responses)

    return types.SimpleNamespace(
        TritonError=TritonError, Tensor=Tensor, InferenceResponse=InferenceResponse, MetricFamily=MetricFamily,
        InferenceRequest=InferenceRequest, TRITONSERVER_RESPONSE_COMPLETE_FINAL=FINAL, bls_requests=requests,
        get_input_tensor_by_name=lambda request, name: request.get(name),
        Logger=types.SimpleNamespace(log_info=print, log_warn=print, log_error=print))


class Sender:
    def __init__(self):
        self.sent = []

    def send(self, response=None, flags=0):
        self.sent.append((response, flags))

    def is_cancelled(self):
        return False


def test_serving_imports_without_triton_or_torch_for_the_sync_model():
    probe = ("import sys, kilnlm.runtime.serving, kilnlm.runtime.serving.triton_backend; "
             "print(','.join(m for m in sys.modules if m.split('.')[0] in ('triton_python_backend_utils', 'torch')))")
    out = subprocess.run([sys.executable, "-c", probe], check=True, capture_output=True, text=True)
    assert out.stdout.strip() == ""
    probe = "import kilnlm.runtime.serving.dispatcher, kilnlm.runtime.serving.launcher, kilnlm.runtime.serving.parameters"
    subprocess.run([sys.executable, "-c", probe], check=True)


def test_input_reader_flattens_tensors():
    pb_utils = fake_pb_utils()
    read = triton_backend.input_reader(pb_utils, {"text_input": Tensor("text_input", np.array([[b"hi"]], dtype=object))})
    assert read("text_input") == [b"hi"] and read("max_tokens") is None


def test_client_sends_tensors_with_final_flag_errors_and_close():
    pb_utils, sender = fake_pb_utils(), Sender()
    client = triton_backend.TritonClient(pb_utils, sender)
    client.send(Reply("a", (1,)))
    client.send(Reply("b", (2, 3), "length", final=True))
    client.send_error("top_p is 1.5", ErrorKind.INVALID_REQUEST)
    client.send_error("engine gone", ErrorKind.INTERNAL)
    client.send_error("queue full", ErrorKind.UNAVAILABLE)
    client.close()
    (first, flags0), (last, flags1), (bad, flags2), (broken, flags3), (busy, flags4), (closed, flags5) = sender.sent
    assert flags0 == 0 and flags1 == flags2 == flags3 == flags4 == flags5 == FINAL
    assert {t.name: t.array.tolist() for t in last.output_tensors()} == {
        "text_output": [b"b"], "output_ids": [2, 3], "sequence_length": [2], "finish_reason": [b"length"]}
    assert first.output_tensors()[0].array.tolist() == [b"a"]
    assert (bad.error().message(), bad.error().code()) == ("top_p is 1.5", "INVALID_ARG")
    assert broken.error().code() == "INTERNAL" and busy.error().code() == "UNAVAILABLE" and closed is None


def test_metrics_backend_makes_triton_families_with_buckets_for_histograms_only():
    MetricFamily.created.clear()
    MetricFamily.deleted.clear()
    metrics = Metrics(triton_backend.TritonMetricsBackend(fake_pb_utils()), "kilnlm")
    gc.collect()
    assert MetricFamily.deleted == []  # the families live as long as the metrics
    kinds = {name: (kind, "buckets" in kwargs) for name, kind, labels, kwargs in MetricFamily.created}
    assert kinds["nv_trt_llm_kv_cache_block_metrics"] == ("GAUGE", False)
    assert kinds["kilnlm_generated_tokens_total"] == ("COUNTER", False)
    assert kinds["kilnlm_time_to_first_token_seconds"] == ("HISTOGRAM", True)
    assert kinds["nv_llm_input_token_len"] == ("HISTOGRAM", True)
    assert all(labels.items() >= {"model": "kilnlm", "version": "1"}.items()
               for _, _, labels, _ in MetricFamily.created)
    # Every series but the per-finish-reason counters (made on first use): 19 nv_trt_llm_* gauges, 2 token
    # length and 4 latency histograms, the cached-blocks gauge, the generated-tokens counter and the 3
    # speculative-decoding gauges.
    assert len(MetricFamily.created) == 30
    metrics.count_finished("stop")
    assert MetricFamily.created[-1][:3] == ("kilnlm_requests_finished_total", "COUNTER",
                                            {"model": "kilnlm", "version": "1", "finish_reason": "stop"})


def test_tokenizer_model_answers_each_request_and_refuses_bad_ones_alone(rt_tokenizer_dir):
    """preprocessing / postprocessing: one conversion per request with the engine's tokenizer and the model's
    boolean parameter; a RequestError answers only its own request, as INVALID_ARG."""
    import json

    from kilnlm.runtime.errors import RequestError

    def convert(read, tokenizer, flag):
        text = read("QUERY")
        if text is None:
            raise RequestError("'QUERY' is missing")
        ids = tokenizer.encode(text.reshape(-1)[0].decode(), add_special_tokens=flag)
        return {"INPUT_ID": np.array([ids], dtype=np.int32)}

    config = {"parameters": {"tokenizer_dir": {"string_value": str(rt_tokenizer_dir)},
                             "add_special_tokens": {"string_value": "false"}}}
    model = triton_backend.TokenizerModel(fake_pb_utils(), {"model_config": json.dumps(config), "model_repository": "/"},
                                          convert, "add_special_tokens")
    good = {"QUERY": Tensor("QUERY", np.array([[b"Paris"]], dtype=object))}
    answered, refused = model.execute([good, {}])
    [ids] = answered.output_tensors()
    assert ids.name == "INPUT_ID" and ids.array.tolist()[0] == model._tokenizer.encode("Paris", add_special_tokens=False)
    assert (refused.error().message(), refused.error().code()) == ("'QUERY' is missing", "INVALID_ARG")
