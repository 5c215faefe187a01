"""kilnlm.runtime: loads a built engine and serves it with in-flight batching over a paged KV cache.

Never imports kilnlm.builder or transformers: a serving image installs only this, kilnlm.plugins and their
small dependencies (torch, numpy, safetensors, tokenizers, jinja2).

Modules, one owner each: ``engine`` (verify + load the compiled engine), ``executor`` (the client API and
the loop), ``scheduler`` (who runs this iteration), ``kv_cache`` (every KV block: free queue, ref counts,
block tables, prefix hashes), ``inputs`` (packing a batch into engine tensors), ``sampler``,
``tokenizer`` / ``detokenizer`` (text in, streamed text out), ``request`` (what crosses the client
boundary).

The data that crosses each boundary, in the order of one executor iteration
(schedule -> prepare inputs -> engine forward -> sample -> update requests -> emit responses):

- ``SamplingParams`` + prompt token ids (request.py): what a client passes to ``Executor.submit``;
  validated there (``RequestError``).
- ``Request`` (request.py): one sequence inside the loop thread -- its token ids (prompt + generated),
  ``num_computed_tokens`` (K/V already in the pool), status, detokenized text, its own
  ``torch.Generator``. Lives from ``submit`` until it finishes, is cancelled or fails.
- ``ScheduledBatch`` (scheduler.py): ``ScheduledSeq``\\ s -- which requests run this iteration and how many
  new tokens each (one in the generation phase, a chunk in the context phase), plus the requests preempted
  to make room. Made by the scheduler after the ``KVCacheManager`` granted blocks.
- ``EngineInputs`` (abi.py): the batch packed into flat tensors (input ids, positions, cu_seqlens, block
  tables, slot mapping, logits indices) for the one engine forward; built by ``InputBuilder``
  (inputs.py) into reused buffers. The engine returns ``logits [B, vocab] float32`` (one row per sequence;
  ``perplexity`` asks for N rows, one per scored token).
- sampled token ids (one per sequence that completed its pending tokens) update the requests;
- ``Response`` (request.py): new token ids and new text (held back while a UTF-8 character or a stop
  string may be incomplete), ``finished`` and ``finish_reason`` ("end_id" | "stop" | "length" |
  "cancelled" | "error"), streamed through ``Executor.stream``.
- ``IterationStats`` (executor.py): a snapshot of the loop's counters for ``Executor.stats()``.
"""
