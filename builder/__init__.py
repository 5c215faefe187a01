"""kilnlm.builder: the compiler. Checkpoint (HF directory or GGUF) -> fused network -> (FP8 calibration)
-> ``torch.export`` -> AOTInductor package -> engine directory with manifest.

- ``checkpoint.py``  ``load_checkpoint(path) -> Checkpoint`` (config, float32 state dict, tokenizer,
  content digest); ``save_as_hf_dir`` (e.g. the bundled GGUF as an ordinary HF directory);
- ``network/``       shared layers (``layers.py``) and one file per architecture (``llama.py``: Llama,
  Mistral, Qwen2) whose ``forward`` is the engine ABI of :mod:`kilnlm.runtime.abi`;
- ``calibration.py`` ``CalibrationConfig``, ``calibration_batches`` (``--calib-data`` text / JSONL, default
  kilnlm's general English text and ``pydoc_data.topics``; deterministic evenly spaced samples);
- ``quantize.py``    ``calibrate_fp8`` with NVIDIA ModelOpt's FP8 recipe;
- ``quantize_int.py`` ``quantize_int(Checkpoint, IntQuantConfig)``: int4_awq / int4_wo / int8_wo / int8_sq with
  ModelOpt's recipes, read back from its unified HF export (``export.py``, also ``--export-checkpoint``);
- ``compile.py``     ``compile_engine`` (export with dynamic T / B / num_blocks, AOTInductor package);
- ``build.py``       ``build_engine(BuildOptions) -> Manifest``, what ``kilnlm build`` runs.

May import kilnlm.runtime (artifact format, smoke test) and kilnlm.plugins; never the reverse.
"""
