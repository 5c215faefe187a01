"""The network the builder compiles: shared layers (``layers.py``, one op per module) composed once per
architecture (``llama.py`` covers Llama, Mistral and Qwen2). Every network's ``forward`` takes exactly the
engine ABI of :mod:`kilnlm.runtime.abi` and returns ``logits [B, vocab] float32``."""
