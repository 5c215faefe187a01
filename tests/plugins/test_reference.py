"""The reference implementations are themselves checked against independent formulations: Hugging Face's
RoPE, and dense (unpaged) causal attention computed with torch's scaled_dot_product_attention."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kilnlm.plugins.reference import (
    apply_rope_reference,
    fp8_linear_reference,
    paged_attention_reference,
    quantize_fp8_reference,
)


def test_rope_matches_hf_llama():
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    num_tokens, num_heads, head_dim = 11, 4, 64
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(num_tokens, num_heads, head_dim, generator=gen)
    positions = torch.tensor([0, 1, 2, 7, 100, 101, 5000, 3, 4, 8191, 12])
    inv_freq = 1.0 / (500000.0 ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    # HF: cos/sin [batch, seq, head_dim] from (inv_freq x positions), x as [batch, heads, seq, head_dim].
    freqs = (inv_freq[None, :, None] @ positions[None, None, :].float()).transpose(1, 2)
    emb = torch.cat((freqs, freqs), dim=-1)
    x_hf = x.transpose(0, 1)[None]
    q_hf, _ = apply_rotary_pos_emb(x_hf, x_hf, emb.cos(), emb.sin())
    torch.testing.assert_close(apply_rope_reference(x, positions, inv_freq), q_hf[0].transpose(0, 1), atol=1e-6,
                               rtol=1e-6)


@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (6, 2)])
def test_paged_reference_matches_dense_causal_attention(make_packed_batch, num_heads, num_kv_heads):
    seqs = [(0, 9), (23, 1), (17, 6)]
    batch = make_packed_batch(seqs, num_heads=num_heads, num_kv_heads=num_kv_heads, tokens_per_block=8)
    pool_before = batch.kv_cache.clone()
    out = paged_attention_reference(*batch.args())
    tpb = batch.kv_cache.shape[3]
    k_rot = apply_rope_reference(batch.k, batch.positions, batch.inv_freq)
    q_rot = apply_rope_reference(batch.q, batch.positions, batch.inv_freq)
    for b, (num_cached, num_new) in enumerate(seqs):
        start, end = int(batch.cu_seqlens_q[b]), int(batch.cu_seqlens_q[b + 1])
        # Dense K/V of this sequence: cached tokens from the original pool, then the new tokens.
        cached_pos = torch.arange(num_cached)
        phys = batch.block_tables[b].long()[cached_pos // tpb]
        k_cached = pool_before[batch.layer_idx, 0, phys, cached_pos % tpb]
        v_cached = pool_before[batch.layer_idx, 1, phys, cached_pos % tpb]
        keys = torch.cat([k_cached, k_rot[start:end]])  # [L, Hkv, D]
        values = torch.cat([v_cached, batch.v[start:end]])
        mask = torch.ones(num_new, num_cached + num_new, dtype=torch.bool).tril(diagonal=num_cached)
        expected = F.scaled_dot_product_attention(q_rot[start:end].transpose(0, 1), keys.transpose(0, 1),
                                                  values.transpose(0, 1), attn_mask=mask, scale=batch.scale,
                                                  enable_gqa=True).transpose(0, 1)
        torch.testing.assert_close(out[start:end], expected, atol=1e-5, rtol=1e-5)


def test_fp8_reference_quantization_saturates_and_rounds():
    scale = torch.tensor(0.5)
    x = torch.tensor([[0.0, 1000.0, -1000.0, 224.0, 0.3, -1e-6]])
    x_q = quantize_fp8_reference(x, scale).float()
    # 1000 / 0.5 saturates at 448; 224 / 0.5 = 448 exactly; 0.6 rounds to the nearest E4M3 value 0.625.
    assert x_q.tolist() == [[0.0, 448.0, -448.0, 448.0, 0.625, -0.0]]
    weight = torch.eye(6).to(torch.float8_e4m3fn)
    y = fp8_linear_reference(x, weight, torch.tensor(1.0), scale, None)
    assert torch.equal(y, x_q * 0.5)
