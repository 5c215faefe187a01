"""kilnlm.builder: the compiler. Checkpoint (HF directory or GGUF) -> (calibration, quantization) -> fused
network -> target compile (CPU: ``torch.export`` + AOTInductor package) -> engine directory with manifest.

- ``config.py``      ``BuildOptions`` (what the user gave, one field per CLI flag) and ``resolve()`` into the
  frozen ``ResolvedBuildOptions`` that the build, the cache key and the manifest read;
- ``formats.py``     the ``--qformat`` registry: one ``QuantFormat`` per format, everything about it;
- ``targets/``       the ``--target`` registry: ``cpu`` (``targets/cpu.py``: export with dynamic T / B /
  num_blocks, AOTInductor package, toolchain versions);
- ``checkpoint.py``  ``load_checkpoint(path) -> Checkpoint`` (config, float32 state dict, tokenizer,
  content digest); ``save_as_hf_dir`` (e.g. the bundled GGUF as an ordinary HF directory); ``float_model``
  (the float32 transformers model ModelOpt calibrates);
- ``network/``       shared layers (``layers.py``) and one file per architecture (``llama.py``: Llama,
  Mistral, Qwen2) whose ``forward`` is the engine ABI of :mod:`kilnlm.runtime.abi`;
- ``calibration.py`` ``CalibrationConfig``, ``calibration_batches`` (``--calib-data`` text / JSONL, default
  kilnlm's general English text and ``pydoc_data.topics``; deterministic evenly spaced samples);
- ``smoothing.py``   SmoothQuant smoothing folded into a checkpoint's float weights (fp8, before it calibrates);
- ``quantize.py``    ``calibrate_fp8`` with NVIDIA ModelOpt's FP8 recipe;
- ``quantize_int.py`` ``quantize_int(Checkpoint, ResolvedBuildOptions)``: the ModelOpt-recipe formats (int4_awq /
  int4_wo / int8_wo / int8_sq), read back from ModelOpt's unified HF export (``export.py``, also
  ``--export-checkpoint``);
- ``cache_key.py``   ``compute_cache_key(ResolvedBuildOptions)``: which builds give interchangeable engines;
- ``build.py``       ``build_engine(BuildOptions | ResolvedBuildOptions) -> Manifest``, what ``kilnlm build`` runs.

May import kilnlm.runtime (artifact format, smoke test) and kilnlm.plugins; never the reverse.
"""
