"""kilnlm.runtime: loads a built engine and serves it with in-flight batching over a paged KV cache.

Never imports kilnlm.builder or transformers' model classes: a serving image installs only this,
kilnlm.plugins and their small dependencies.

The data that crosses each boundary, in the order of one executor iteration:

- ``Request`` (request.py): what a client submitted -- prompt token ids and ``SamplingParams``; lives in
  the executor from ``submit`` until it finishes or is cancelled.
- ``ScheduledBatch`` (scheduler.py): which requests run this iteration and how many of their tokens
  (a context chunk or one generation token each); made by the scheduler after the KV-cache manager
  granted their blocks.
- ``EngineInputs`` (abi.py): the packed tensors of that batch for the one engine forward.
- ``StepOutput``: the sampled token per sequence; turned into ``Response`` objects (new token ids,
  new text, finish reason) streamed back to the caller.
"""
