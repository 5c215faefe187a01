"""SmoothQuant smoothing folded into the float weights (kilnlm.builder.smoothing), as fp8 builds use it."""

from __future__ import annotations

import pytest
import torch

from kilnlm.builder.checkpoint import float_model, load_checkpoint
from kilnlm.builder.errors import BuildError
from kilnlm.builder.smoothing import activation_amax, smooth_checkpoint


@pytest.fixture(scope="module", params=["llama", "qwen2"])  # qwen2: biased q / k / v, so v_proj's bias scales too
def tiny_checkpoint(request, smollm2_hf_dir, tmp_path_factory):
    from factories import make_tiny_checkpoint

    return load_checkpoint(make_tiny_checkpoint(tmp_path_factory.mktemp(request.param), smollm2_hf_dir, request.param))


def token_batches(num: int = 3, seq_len: int = 24) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 49152, (1, seq_len), generator=g) for _ in range(num)]


def test_smoothing_keeps_the_function_and_evens_the_activations(tiny_checkpoint):
    """The smoothed checkpoint computes the same logits in float32, while every decoder linear's input, per
    channel, is divided by its smoothing scale: with alpha 1, s_j = max|X_j| / max|W_j|^0 folds each channel's
    whole range into the weights, so every channel's amax becomes 1. Fails if a fold is missing or misplaced
    (a norm, v_proj's rows and bias, up_proj's rows, or o_proj's GQA grouping)."""
    ck = tiny_checkpoint
    batches = token_batches()
    amax = activation_amax(ck, batches)
    assert len(amax) == 7 * ck.config.num_hidden_layers
    smoothed = smooth_checkpoint(ck, amax, alpha=1.0)
    assert smoothed.smoothing_alpha == 1.0 and ck.smoothing_alpha is None
    x = torch.cat(batches)
    with torch.no_grad():
        expected, got = float_model(ck)(x).logits, float_model(smoothed)(x).logits
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    after = activation_amax(smoothed, batches)
    for name, a in after.items():
        if name.endswith("o_proj"):  # one scale per KV-head channel, the max over the query heads sharing it
            cfg = ck.config
            grouped = a.view(cfg.num_key_value_heads, -1, cfg.head_dim).amax(dim=1)
            torch.testing.assert_close(grouped, torch.ones_like(grouped), rtol=1e-4, atol=0)
        else:
            torch.testing.assert_close(a, torch.ones_like(a), rtol=1e-4, atol=0, msg=name)
    assert not torch.equal(smoothed.state_dict["model.layers.0.input_layernorm.weight"],
                           ck.state_dict["model.layers.0.input_layernorm.weight"])


def test_a_smoothed_checkpoint_is_not_smoothed_twice(tiny_checkpoint):
    ck = tiny_checkpoint
    amax = activation_amax(ck, token_batches(1))
    with pytest.raises(BuildError, match="smoothed already"):
        smooth_checkpoint(smooth_checkpoint(ck, amax, 0.3), amax, 0.3)


def test_fp8_builds_smooth_with_the_formats_alpha(tiny_llama_dir, tmp_path):
    """An fp8 build's options resolve --smoothquant-alpha to fp8's own, and its network is made from the
    smoothed weights: a different alpha gives different FP8 weights."""
    from kilnlm.builder.build import smooth_checkpoint_for
    from kilnlm.builder.config import BuildOptions, resolve
    from kilnlm.builder.formats import FORMATS

    opts = resolve(BuildOptions(checkpoint=tiny_llama_dir, output=tmp_path / "e", qformat="fp8", calib_size=2,
                                calib_max_seq_len=32))
    assert opts.smoothquant_alpha == FORMATS["fp8"].smoothing_alpha is not None
    ck = load_checkpoint(tiny_llama_dir)
    smoothed = smooth_checkpoint_for(opts, ck)
    assert smoothed.smoothing_alpha == opts.smoothquant_alpha
    assert smooth_checkpoint_for(opts, smoothed) is smoothed
    rowwise = resolve(BuildOptions(checkpoint=tiny_llama_dir, output=tmp_path / "r", qformat="fp8_rowwise"))
    assert rowwise.smoothquant_alpha is None and smooth_checkpoint_for(rowwise, ck) is ck
