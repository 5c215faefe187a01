"""Compiled engines call the kilnlm ops through their C shims (plugins/csrc/c_shim.h), not AOTInductor's
proxy executor; engines compiled before the shims still run; an op's error keeps its message."""

from __future__ import annotations

import re
import zipfile

import pytest
import torch

from conftest import TINY_ENGINE_LIMITS, build_test_engine
from factories import make_engine_inputs

from kilnlm.plugins import PLUGIN_VERSIONS
from kilnlm.plugins.cpu import CSRC_DIR
from kilnlm.plugins.schema import c_shim_declaration
from kilnlm.runtime.engine import Engine


def wrapper_source(engine_dir) -> str:
    with zipfile.ZipFile(engine_dir / "model.pt2") as package:
        (name,) = [n for n in package.namelist() if n.endswith(".wrapper.cpp")]
        return package.read(name).decode()


def c_definitions() -> dict[str, str]:
    """op name -> the parameter list of its ``KILN_C_SHIM aoti_torch_cpu_<op>(...)`` definition in csrc/*.cpp,
    whitespace normalized."""
    found = {}
    for path in CSRC_DIR.glob("*.cpp"):
        for name, params in re.findall(r"KILN_C_SHIM aoti_torch_cpu_(\w+)\(([^)]*)\)", path.read_text()):
            found[name] = " ".join(params.split())
    return found


def test_every_op_has_a_c_shim_matching_its_schema():
    """The declaration an engine is compiled with (written from the op's schema) and the definition in the
    kernels library must agree parameter for parameter: a mismatch would not fail to link, it would pass
    arguments wrongly."""
    definitions = c_definitions()
    assert set(definitions) == set(PLUGIN_VERSIONS)
    for name in PLUGIN_VERSIONS:
        declared = re.fullmatch(rf"AOTITorchError aoti_torch_cpu_{name}\((.*)\)", c_shim_declaration(name)).group(1)
        assert definitions[name] == declared, name


def test_engine_calls_the_ops_through_their_c_shims(tiny_engine_dir):
    source = wrapper_source(tiny_engine_dir)
    layers = 2  # the tiny checkpoint's num_hidden_layers
    assert len(re.findall(r"AOTI_TORCH_ERROR_CODE_CHECK\(aoti_torch_cpu_paged_attention\(", source)) == layers
    assert len(re.findall(r"AOTI_TORCH_ERROR_CODE_CHECK\(aoti_torch_cpu_gemm\(", source)) == 4 * layers + 1
    assert "aoti_torch_proxy_executor_call_function(" not in source


@pytest.fixture(scope="module")
def proxy_engine_dir(tiny_llama_dir, tmp_path_factory):
    """The tiny fp32 engine compiled as before the C shims: ops through the proxy executor, and the plugin
    versions of then (paged_attention 2, gemm 1) in its manifest."""
    import kilnlm.builder.targets.cpu as compile_module

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(compile_module, "c_shim_configs", lambda: {})
        patch.setitem(PLUGIN_VERSIONS, "paged_attention", 2)
        patch.setitem(PLUGIN_VERSIONS, "gemm", 1)
        return build_test_engine(tiny_llama_dir, tmp_path_factory.mktemp("engines") / "tiny_fp32_proxy",
                                 qformat="fp32", **TINY_ENGINE_LIMITS)


def engine_logits(engine_dir, block_offset: int = 0) -> torch.Tensor:
    engine = Engine.load(engine_dir)
    build = engine.manifest.build
    inputs = make_engine_inputs([([5, 17, 301, 42, 7], 0), ([9, 8], 0)], build.tokens_per_block, build.max_blocks_per_seq)
    if block_offset:
        inputs.block_tables.add_(block_offset)
    kv_cache = engine.allocate_kv_cache(2 * build.max_blocks_per_seq)
    return engine.forward(inputs, kv_cache)


def test_engine_from_before_the_c_shims_still_runs(tiny_engine_dir, proxy_engine_dir):
    source = wrapper_source(proxy_engine_dir)
    assert "aoti_torch_cpu_paged_attention(" not in source and "aoti_torch_proxy_executor_call_function(" in source
    torch.testing.assert_close(engine_logits(proxy_engine_dir), engine_logits(tiny_engine_dir), rtol=0, atol=0)


def test_op_error_in_the_forward_keeps_its_message(tiny_engine_dir):
    """A block id past the pool's end is caught by paged_attention's checks; the RuntimeError says so (not
    only AOTInductor's "API call failed"), and the next forward runs normally."""
    with pytest.raises(RuntimeError, match=r"kilnlm::paged_attention: block_tables\[0, 0\] = \d+"):
        engine_logits(tiny_engine_dir, block_offset=10_000)
    assert torch.isfinite(engine_logits(tiny_engine_dir)).all()
