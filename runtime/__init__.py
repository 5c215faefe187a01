"""kilnlm.runtime: loads a built engine and serves it with in-flight batching over a paged KV cache.

Never imports kilnlm.builder or transformers: a serving image installs only this, kilnlm.plugins and their
small dependencies (torch, numpy, safetensors, tokenizers, jinja2, cryptography). Structured output needs the
``kilnlm[guided]`` extra (xgrammar, which itself imports transformers), loaded on the first guided request.

Modules, one owner each: ``engine`` (verify + load an engine; the :class:`Engine` the loop calls; ``signing``
checks its Ed25519 signature against trusted keys first) over
``backends`` (one engine backend per build target: ``cpu`` = AOTInductor), ``executor`` (the client API
and the loop), ``scheduler`` (who runs this iteration; computed-token counts, appending sampled tokens, end
id / length finishes), ``kv_cache`` (every KV block: free queue, ref counts, block tables, prefix hashes;
the pool's size), ``inputs`` (packing a batch into engine tensors), ``sampler``, ``guided_decoding``
(structured output: xgrammar's grammar matchers and the token bitmask of each step), ``output_processor``
(detokenizing, stop strings, hold-back, responses), ``tokenizer`` / ``detokenizer`` (text in, streamed
text out), ``request`` (what crosses the client boundary).

Two subpackages sit beside the loop: ``serving`` (what every serving front shares: request parsing into
``SamplingParams``, response shaping, metrics, the tritonserver launcher) and ``distribution`` (the engine
cache, references, deploys into a Triton repository, the served model's engine source).

The data that crosses each boundary, in the order of one executor iteration (``Executor.step``)::

    schedule -> prepare inputs -> engine forward -> sample -> update requests -> emit responses

============================  =====================  ==================================================
boundary dataclass            made by                what it carries
============================  =====================  ==================================================
``SamplingParams`` + prompt   the client             how to sample and when to stop; validated by
(request.py)                                         ``Executor.submit`` (``RequestError``)
``Request`` (request.py)      ``Executor.submit``    one sequence in the loop thread (``n`` of them per
                                                     client request: ``parent_request_id``,
                                                     ``sequence_index``): token ids (prompt +
                                                     generated), ``num_computed_tokens`` (K/V in the
                                                     pool), status, finish reason, streamed text state,
                                                     its own ``torch.Generator``, the latest token's
                                                     log-probs and ``cum_log_prob``; lives until
                                                     finished
``ScheduledBatch``            ``Scheduler.schedule`` ``ScheduledSeq``\\ s: which requests run and how
(scheduler.py)                                       many new tokens each (1 in the generation phase, a
                                                     chunk in the context phase), and the requests
                                                     preempted to make room; after the
                                                     ``KVCacheManager`` granted blocks
``EngineInputs`` (abi.py)     ``InputBuilder.build`` the batch as flat tensors (input ids, positions,
                                                     cu_seqlens, block tables, slot mapping, logits
                                                     indices) in reused buffers, valid until the next
                                                     build; ``Engine.forward`` returns ``logits [B,
                                                     vocab] float32`` (``perplexity``: N rows)
``SamplerOutput``             ``Sampler.sample``     one token id per sequence that completed its pending
(sampler.py)                                         tokens, in batch order (after penalties, bad words
                                                     / ``min_tokens`` masks, greedy or temperature /
                                                     top-k / top-p), and for the rows that asked, its
                                                     ``TokenLogprobs`` (raw-logit log-prob, top
                                                     alternatives), which the executor sets as each
                                                     ``Request.last_logprobs``
updated ``Request``\\ s        ``Scheduler.update``   computed tokens advanced, full blocks registered
                                                     for prefix reuse, the token appended -- or the
                                                     request finished ("end_id" / "length", blocks freed)
``Response`` (request.py)     ``OutputProcessor``    new token ids and new text (held back while a UTF-8
                                                     character or a stop string may be incomplete),
                                                     ``finished`` (per sequence), ``finish_reason``
                                                     ("end_id" | "stop" | "length" | "cancelled" |
                                                     "error"), ``sequence_index``, the new tokens'
                                                     ``log_probs`` / ``top_logprobs`` and
                                                     ``cum_log_prob``, the queue time; streamed through
                                                     ``Executor.stream`` (ends after every sequence's
                                                     final response)
``IterationStats``            the loop thread        a snapshot of the loop's counters (requests, KV
(executor.py)                                        blocks, prefix reuse, the last iteration's phases)
                                                     for ``Executor.stats()`` and the metrics
============================  =====================  ==================================================
"""
