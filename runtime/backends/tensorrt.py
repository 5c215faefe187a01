"""The ``tensorrt`` target's engine backend: a serialized TensorRT plan (``rank0.engine``) run by TensorRT's
Python runtime on one NVIDIA GPU, with the paged KV pool in GPU memory (torch CUDA tensors).

The plan's I/O tensors are the engine ABI (:mod:`kilnlm.runtime.abi`) by name::

    inputs   input_ids [T] int64, positions [T] int64, cu_seqlens_q [B+1] int32, seq_lens_kv [B] int32,
             block_tables [B, max_blocks_per_seq] int32, slot_mapping [T] int64, logits_indices [N] int64,
             past_key_value_{l} [2, num_blocks, tokens_per_block, num_kv_heads, head_dim] KV dtype, per layer l
    outputs  logits [N, vocab_size] float32, present_key_value_{l} per layer (aliases past_key_value_{l}:
             the attention plugin writes the pool in place, so both names are bound to kv_cache[l])

A plan runs only under the TensorRT version that built it and on GPUs of the compute capability it was built
for (``toolchain.tensorrt``, ``toolchain.cuda_compute_capability``); :meth:`TensorRTBackend.verify` compares
both with this machine before anything is deserialized (:func:`plan_compatibility_problem`).

Importing this module imports neither ``tensorrt`` nor any CUDA binding: ``verify`` and ``load`` do.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch

from kilnlm.runtime.abi import INPUT_NAMES, KV_CACHE_DTYPES, EngineInputs, kv_cache_bytes_per_block, kv_cache_shape
from kilnlm.runtime.errors import EngineError
from kilnlm.runtime.manifest import MANIFEST_NAME, Manifest

REBUILD = "rebuild with `kilnlm build --from-onnx DIR --target tensorrt` on this machine"


def kv_tensor_names(layer: int) -> tuple[str, str]:
    """The plan's input and output name of layer ``layer``'s KV pool (one device address for both)."""
    return f"past_key_value_{layer}", f"present_key_value_{layer}"


def plan_compatibility_problem(toolchain: dict[str, str], installed_trt: str | None, device_capability: str | None,
                               device_name: str | None, trt_import_error: str = "") -> str | None:
    """Why a plan built with ``toolchain`` (a manifest's: ``tensorrt`` version, ``cuda_compute_capability``
    "major.minor", ``gpu`` name) cannot run here, or None when it can. This machine: ``installed_trt``
    (``tensorrt.__version__``, None when it cannot be imported, ``trt_import_error`` saying why),
    ``device_capability`` ("major.minor" of the current CUDA device, None without one) and ``device_name``.
    Versions compare as whole strings: TensorRT plans are not portable across any two builds."""
    built_trt = toolchain.get("tensorrt")
    built_cc = toolchain.get("cuda_compute_capability")
    built_gpu = toolchain.get("gpu", "unknown GPU")
    if not built_trt or not built_cc:
        return ("build.target is 'tensorrt' but the toolchain records no TensorRT version or compute capability "
                f"(toolchain.tensorrt, toolchain.cuda_compute_capability): not a kilnlm tensorrt engine; {REBUILD}")
    if installed_trt is None:
        why = f" ({trt_import_error})" if trt_import_error else ""
        return (f"the plan was built by TensorRT {built_trt} for compute capability {built_cc} ({built_gpu}); this "
                f"machine has no TensorRT{why}: pip install 'kilnlm[tensorrt]' (the tensorrt wheel for your CUDA) on "
                f"a machine with an NVIDIA GPU of compute capability {built_cc}")
    if device_capability is None:
        return (f"the plan needs an NVIDIA GPU of compute capability {built_cc} (built on {built_gpu}) but this "
                "machine has no CUDA device (torch.cuda.is_available() is False): serve it on such a GPU with a "
                "CUDA build of torch")
    if installed_trt != built_trt:
        return (f"plan built by TensorRT {built_trt}, this machine has TensorRT {installed_trt}: TensorRT plans are "
                f"not portable across versions; {REBUILD} (or install tensorrt=={built_trt})")
    if device_capability != built_cc:
        return (f"plan built for compute capability {built_cc} ({built_gpu}) but this GPU ({device_name}) has "
                f"compute capability {device_capability}: a plan runs only on the compute capability it was built "
                f"for; {REBUILD}, or serve it on a GPU of compute capability {built_cc}")
    return None


def plan_io_problem(io_modes: dict[str, str], num_layers: int) -> str | None:
    """What the plan's I/O tensors (``io_modes``: name -> "input" | "output") lack of the engine ABI for
    ``num_layers`` layers, or None when every ABI input and output is there in its role."""
    kv = [kv_tensor_names(layer) for layer in range(num_layers)]
    inputs = [*INPUT_NAMES, *(past for past, _ in kv)]
    outputs = ["logits", *(present for _, present in kv)]
    missing = ([f"input {n}" for n in inputs if io_modes.get(n) != "input"]
               + [f"output {n}" for n in outputs if io_modes.get(n) != "output"])
    if not missing:
        return None
    return (f"the plan lacks the engine ABI's {', '.join(missing)} (it has {', '.join(sorted(io_modes)) or 'none'}): "
            f"it was not built by this kilnlm's tensorrt target; {REBUILD}")


def installed_tensorrt() -> tuple[str | None, str]:
    """``(tensorrt.__version__, "")``, or ``(None, why)`` when ``import tensorrt`` fails (not installed, or
    installed without its shared libraries: ImportError / OSError)."""
    try:
        import tensorrt
    except (ImportError, OSError) as exc:
        return None, f"import tensorrt: {type(exc).__name__}: {exc}"
    return str(tensorrt.__version__), ""


def current_device() -> tuple[str | None, str | None]:
    """``("major.minor", name)`` of the current CUDA device, ``(None, None)`` without one."""
    if not torch.cuda.is_available():
        return None, None
    major, minor = torch.cuda.get_device_capability()
    return f"{major}.{minor}", torch.cuda.get_device_name()


class TensorRTBackend:
    """A loaded ``tensorrt`` engine: the deserialized plan (``engine``), its execution context (``context``)
    and persistent device buffers at the build limits (``max_num_tokens``, ``max_batch_size``) that every
    forward copies its inputs into and reads its logits from."""

    target = "tensorrt"

    def __init__(self, manifest: Manifest, runtime, engine, context) -> None:
        self.manifest = manifest
        self.runtime, self.engine, self.context = runtime, engine, context  # held: the runtime must outlive its engine
        self.model = manifest.model
        self.kv_cache_dtype = KV_CACHE_DTYPES[manifest.build.kv_cache_dtype]
        build, cuda = manifest.build, torch.device("cuda")
        T, B = build.max_num_tokens, build.max_batch_size
        i32, i64 = torch.int32, torch.int64
        self.buffers = {  # the ABI inputs at their largest shapes, device
            "input_ids": torch.zeros(T, dtype=i64, device=cuda), "positions": torch.zeros(T, dtype=i64, device=cuda),
            "cu_seqlens_q": torch.zeros(B + 1, dtype=i32, device=cuda),
            "seq_lens_kv": torch.zeros(B, dtype=i32, device=cuda),
            "block_tables": torch.zeros(B, build.max_blocks_per_seq, dtype=i32, device=cuda),
            "slot_mapping": torch.zeros(T, dtype=i64, device=cuda),
            "logits_indices": torch.zeros(T, dtype=i64, device=cuda),
        }
        self.logits = torch.empty(T, self.model.vocab_size, dtype=torch.float32, device=cuda)  # [max_num_tokens, vocab]
        for name, buffer in self.buffers.items():
            context.set_tensor_address(name, buffer.data_ptr())
        context.set_tensor_address("logits", self.logits.data_ptr())

    @classmethod
    def verify(cls, engine_dir: Path, manifest: Manifest) -> None:
        """Refuse, reading files only (no plan is deserialized): a tensor-parallel engine, a missing plan, a
        machine without TensorRT or a CUDA device, a TensorRT version other than the plan's, or a GPU of
        another compute capability (:func:`plan_compatibility_problem`). Raises :class:`EngineError`."""
        where = engine_dir / MANIFEST_NAME
        if manifest.build.tp_size != 1:
            raise EngineError(f"{where}: build.tp_size is {manifest.build.tp_size} but tensor parallelism is not "
                              "supported by this backend (tensorrt): rebuild the engine with --tp-size 1")
        plan = engine_dir / manifest.rank_engine_file(0)
        if not plan.is_file():
            raise EngineError(f"{where}: the TensorRT plan {plan} is missing: the engine is incomplete; rebuild it "
                              "or pull it again from the cache")
        installed_trt, import_error = installed_tensorrt()
        capability, name = current_device()
        problem = plan_compatibility_problem(manifest.toolchain, installed_trt, capability, name, import_error)
        if problem is not None:
            raise EngineError(f"cannot serve {engine_dir}: {problem}")

    @classmethod
    def load(cls, engine_dir: Path, manifest: Manifest, rank: int = 0,
             while_loading: Callable[[], None] | None = None) -> "TensorRTBackend":
        """Deserialize the verified plan of rank ``rank`` (0: the only one) on the current CUDA device, check
        that its I/O tensors are the engine ABI (:func:`plan_io_problem`) and create its execution context
        and device buffers. Raises :class:`EngineError` when the plan does not deserialize (corrupt, or a
        TensorRT / GPU other than :meth:`verify` saw), lacks an ABI tensor or gets no context."""
        import tensorrt as trt

        if while_loading is not None:  # first: which of the calls below release the GIL is not measured
            while_loading()
        plan = engine_dir / manifest.rank_engine_file(rank)
        torch.cuda.init()  # TensorRT runs in torch's (primary) CUDA context of the current device
        runtime = trt.Runtime(trt.Logger(trt.Logger.WARNING))
        engine = runtime.deserialize_cuda_engine(plan.read_bytes())
        if engine is None:
            raise EngineError(f"TensorRT {trt.__version__} cannot deserialize {plan} (its log above says why): the "
                              f"plan is corrupt or was built for another TensorRT or GPU; {REBUILD}")
        names = [engine.get_tensor_name(i) for i in range(engine.num_io_tensors)]
        io_modes = {name: {trt.TensorIOMode.INPUT: "input", trt.TensorIOMode.OUTPUT: "output"}.get(
            engine.get_tensor_mode(name), "none") for name in names}
        problem = plan_io_problem(io_modes, manifest.model.num_layers)
        if problem is not None:
            raise EngineError(f"cannot serve {plan}: {problem}")
        context = engine.create_execution_context()
        if context is None:
            raise EngineError(f"TensorRT cannot create an execution context for {plan} (out of GPU memory?): free "
                              "GPU memory or serve it on a larger GPU")
        return cls(manifest, runtime, engine, context)

    def kv_cache_bytes_per_block(self) -> int:
        """Bytes one KV block takes over all layers (K and V) in ``kv_cache_dtype``."""
        m = self.model
        return kv_cache_bytes_per_block(m.num_layers, self.manifest.build.tokens_per_block, m.num_kv_heads, m.head_dim,
                                        self.kv_cache_dtype)

    def allocate_kv_cache(self, num_blocks: int) -> torch.Tensor:
        """Zeros ``[num_layers, 2, num_blocks, tokens_per_block, num_kv_heads, head_dim]`` in ``kv_cache_dtype``
        on the current CUDA device (contiguous: layer l's pool ``kv_cache[l]`` is one device range)."""
        m = self.model
        shape = kv_cache_shape(m.num_layers, num_blocks, self.manifest.build.tokens_per_block, m.num_kv_heads, m.head_dim)
        return torch.zeros(shape, dtype=self.kv_cache_dtype, device=torch.device("cuda"))

    def forward(self, inputs: EngineInputs, kv_cache: torch.Tensor) -> torch.Tensor:
        """One plan execution on the current CUDA stream: ``inputs`` (CPU, :mod:`kilnlm.runtime.abi` shapes)
        are copied into the device buffers, every input's shape is set (the pools' with ``kv_cache``'s
        num_blocks), both KV names of layer l are bound to ``kv_cache[l]`` (``kv_cache``: the pool from
        :meth:`allocate_kv_cache`, written in place). Returns ``logits [N, vocab_size] float32``, CPU (a copy,
        after the stream has finished). Raises :class:`EngineError` when TensorRT fails to execute."""
        context = self.context
        for name in INPUT_NAMES:
            value = getattr(inputs, name)
            self.buffers[name][: value.shape[0]].copy_(value)
            context.set_input_shape(name, tuple(value.shape))
        pool_shape = tuple(kv_cache.shape[1:])  # [2, num_blocks, tokens_per_block, num_kv_heads, head_dim]
        for layer in range(self.model.num_layers):
            past, present = kv_tensor_names(layer)
            address = kv_cache[layer].data_ptr()
            context.set_input_shape(past, pool_shape)
            context.set_tensor_address(past, address)
            context.set_tensor_address(present, address)
        stream = torch.cuda.current_stream()
        if not context.execute_async_v3(stream.cuda_stream):
            raise EngineError(f"TensorRT failed to execute the plan on a batch of {inputs.num_tokens} tokens, "
                              f"{inputs.num_seqs} sequences (its log above says why)")
        return self.logits[: inputs.num_logits].to("cpu")  # [N, vocab_size]; blocking: waits for the stream
