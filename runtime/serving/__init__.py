"""kilnlm.runtime.serving: what every serving front (the Triton models, an OpenAI-compatible server) shares.

Framework-free modules (no ``triton_python_backend_utils``, no web framework), one owner each:

- ``trtllm``: TensorRT-LLM's ``inflight_batcher_llm`` tensor conventions, what the Triton models compute
  (preprocessing, the ``tensorrt_llm`` model's inputs -> ``SamplingParams`` and its output tensors,
  postprocessing, the ensemble's wiring that ``tensorrt_llm_bls`` follows);
- ``request_parsing``: a text request's named inputs (a JSON body with the ensemble's names; the
  dispatcher's default text protocol) -> :class:`~kilnlm.runtime.serving.request_parsing.GenerateRequest`
  -> prompt token ids + :class:`~kilnlm.runtime.request.SamplingParams`;
- ``parameters``: a served model's string parameters (config.pbtxt) -> ``ExecutorConfig`` and defaults;
- ``responses``: the executor's streamed ``Response``\\ s of one request -> the replies a client gets
  (:class:`~kilnlm.runtime.serving.responses.Reply`: text, token ids, finish reason) and their output
  tensors (``text_output``, ``output_ids``, ``sequence_length``, ``finish_reason``);
- ``metrics``: TensorRT-LLM's ``nv_trt_llm_*`` gauges (requests, KV-cache blocks, in-flight batcher,
  iterations) and token-length histograms, plus ``kilnlm_*`` TTFT / inter-token / queue / end-to-end
  latency histograms and finish-reason and token counters, over any metrics backend (Triton's custom
  metrics, prometheus-client, in memory);
- ``dispatcher``: the threads between one executor and many clients (one reader per request, one
  dispatcher thread owning every client connection, cancellation polling, stats refresh);
- ``launcher``: finding and starting a real ``tritonserver`` (binary, Python backend with its stub, model
  repository, command line, environment, foreground run); ``scripts/launch_triton.py`` is its entry point.

Framework glue: ``triton_backend`` adapts Triton's Python backend (requests, response senders, metric
families) to the modules above; it takes the ``triton_python_backend_utils`` module as an argument, so it
too imports anywhere. ``model_repository/*/1/model.py`` are thin adapters over it.

The OpenAI-compatible front (``kilnlm serve``): ``openai_protocol`` (OpenAI's request bodies ->
``SamplingParams``; responses, chunks, log-probs, usage and errors in OpenAI's shapes) and
``openai_server`` (the FastAPI application on uvicorn, its threads and cancellation); they import FastAPI
and pydantic, so nothing else here imports them. Its ``/metrics`` renders the metrics through
``metrics.PrometheusBackend``.
"""
