"""The network in eager mode (before compilation) against Hugging Face transformers: architectures,
QKV bias, RoPE scaling variants, and the checkpoint loader."""

from __future__ import annotations

import shutil

import pytest
import torch

from factories import make_engine_inputs, make_tiny_checkpoint

from kilnlm.builder.checkpoint import load_checkpoint
from kilnlm.builder.errors import BuildError
from kilnlm.builder.network.layers import rope_inv_freq
from kilnlm.builder.network.llama import LlamaNetwork, model_config_from_hf

ATOL = 1e-4
PROMPTS = [[1, 9519, 28, 314, 1345, 42, 7, 11], [500, 600, 700], list(range(1000, 1041))]


@pytest.fixture(scope="module", autouse=True)
def cpu_kernels():
    from kilnlm.plugins import load_cpu_kernels

    load_cpu_kernels()


def eager_vs_hf(checkpoint_dir) -> None:
    from transformers import AutoModelForCausalLM

    ck = load_checkpoint(checkpoint_dir)
    cfg = model_config_from_hf(ck.config)
    network = LlamaNetwork(cfg, ck.state_dict, torch.float32).eval()
    hf = AutoModelForCausalLM.from_pretrained(checkpoint_dir, dtype=torch.float32).eval()
    tpb, max_blocks = 16, 4
    inputs = make_engine_inputs([(p, 0) for p in PROMPTS], tpb, max_blocks)
    kv_cache = torch.zeros(cfg.num_layers, 2, len(PROMPTS) * max_blocks, tpb, cfg.num_kv_heads, cfg.head_dim)
    with torch.no_grad():
        logits = network(*inputs.as_args(kv_cache))
        for b, prompt in enumerate(PROMPTS):
            torch.testing.assert_close(logits[b], hf(torch.tensor([prompt])).logits[0, -1], atol=ATOL, rtol=0)


@pytest.mark.parametrize("architecture", ["qwen2", "mistral"])
def test_other_architectures_match_hf(architecture, smollm2_hf_dir, tmp_path):
    """Qwen2 (q/k/v biases, untied LM head) and Mistral (untied LM head)."""
    eager_vs_hf(make_tiny_checkpoint(tmp_path / architecture, smollm2_hf_dir, architecture))


@pytest.mark.parametrize("rope_parameters", [
    {"rope_type": "linear", "factor": 4.0},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 64},
])
def test_rope_scaling_matches_hf(rope_parameters, smollm2_hf_dir, tmp_path):
    params = dict(rope_parameters, rope_theta=10000.0)
    eager_vs_hf(make_tiny_checkpoint(tmp_path / "rope", smollm2_hf_dir, "llama", rope_parameters=params))


def test_rope_inv_freq_matches_transformers():
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    config = LlamaConfig(hidden_size=4096, num_attention_heads=32, max_position_embeddings=131072,
                         rope_parameters=dict(scaling, rope_theta=500000.0))
    expected, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    torch.testing.assert_close(rope_inv_freq(128, 500000.0, scaling), expected.float())


def test_unsupported_rope_type_is_refused():
    with pytest.raises(BuildError, match="rope_scaling type 'yarn'"):
        rope_inv_freq(64, 10000.0, {"rope_type": "yarn", "factor": 4.0})


def test_checkpoint_digest_follows_content_not_location(tiny_llama_dir, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(tiny_llama_dir, copy)
    assert load_checkpoint(copy).digest == load_checkpoint(tiny_llama_dir).digest
    (copy / "config.json").write_text((copy / "config.json").read_text().replace('"rms_norm_eps": 1e-05', '"rms_norm_eps": 2e-05'))
    assert load_checkpoint(copy).digest != load_checkpoint(tiny_llama_dir).digest


def test_sharded_checkpoint_loads_like_single_file(tiny_llama_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    sharded = tmp_path / "sharded"
    AutoModelForCausalLM.from_pretrained(tiny_llama_dir).save_pretrained(sharded, max_shard_size="2MB")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_llama_dir / name, sharded / name)
    assert len(list(sharded.glob("*.safetensors"))) > 1
    single, multi = load_checkpoint(tiny_llama_dir).state_dict, load_checkpoint(sharded).state_dict
    assert single.keys() == multi.keys()
    assert all(torch.equal(single[k], multi[k]) for k in single)


def test_gguf_and_converted_dir_hold_the_same_weights(smollm2_gguf_path, smollm2_hf_dir):
    gguf, hf_dir = load_checkpoint(smollm2_gguf_path), load_checkpoint(smollm2_hf_dir)
    assert gguf.architecture == hf_dir.architecture == "LlamaForCausalLM"
    assert gguf.digest.startswith("sha256:") and gguf.digest != hf_dir.digest
    assert gguf.state_dict.keys() == hf_dir.state_dict.keys()
    assert all(torch.equal(gguf.state_dict[k], hf_dir.state_dict[k]) for k in gguf.state_dict)
    cfg = model_config_from_hf(hf_dir.config)
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.vocab_size) == (30, 576, 9, 3, 49152)
    assert cfg.tie_word_embeddings
