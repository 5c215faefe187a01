"""The ops inside torch.export + AOTInductor: a 2-layer toy network calling both ops is exported with a
dynamic token count, compiled and packaged, loaded back, and must equal eager execution -- including
the KV pool passed as an input being mutated in place by the compiled package."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.usefixtures("cpu_kernels")

HIDDEN, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, NUM_LAYERS = 128, 4, 2, 32, 2


class ToyAttentionNet(torch.nn.Module):
    """x -> per layer: fp8 qkv projection -> paged attention -> fp8 output projection (+ residual)."""

    def __init__(self, gen: torch.Generator):
        super().__init__()
        qkv_out = (NUM_HEADS + 2 * NUM_KV_HEADS) * HEAD_DIM
        for i in range(NUM_LAYERS):
            self.register_buffer(f"w_qkv{i}", (torch.randn(qkv_out, HIDDEN, generator=gen) * 8).to(torch.float8_e4m3fn))
            self.register_buffer(f"w_o{i}", (torch.randn(HIDDEN, NUM_HEADS * HEAD_DIM, generator=gen) * 8)
                                 .to(torch.float8_e4m3fn))
            self.register_buffer(f"b_o{i}", torch.randn(HIDDEN, generator=gen))
        self.register_buffer("w_scale", torch.tensor(0.02))
        self.register_buffer("x_scale", torch.tensor(0.01))
        self.register_buffer("inv_freq", 1.0 / (10000 ** (torch.arange(0, HEAD_DIM, 2).float() / HEAD_DIM)))

    def forward(self, x, positions, cu_seqlens_q, seq_lens_kv, block_tables, slot_mapping, kv_cache):
        num_tokens = x.shape[0]
        for i in range(NUM_LAYERS):
            qkv = torch.ops.kilnlm.fp8_linear(x, getattr(self, f"w_qkv{i}"), self.w_scale, self.x_scale, None)
            q, k, v = qkv.split([NUM_HEADS * HEAD_DIM, NUM_KV_HEADS * HEAD_DIM, NUM_KV_HEADS * HEAD_DIM], dim=-1)
            attn = torch.ops.kilnlm.paged_attention(
                q.reshape(num_tokens, NUM_HEADS, HEAD_DIM), k.reshape(num_tokens, NUM_KV_HEADS, HEAD_DIM),
                v.reshape(num_tokens, NUM_KV_HEADS, HEAD_DIM), kv_cache, i, positions, self.inv_freq, cu_seqlens_q,
                seq_lens_kv, block_tables, slot_mapping, HEAD_DIM ** -0.5)
            x = x + torch.ops.kilnlm.fp8_linear(attn.reshape(num_tokens, -1), getattr(self, f"w_o{i}"), self.w_scale,
                                                self.x_scale, getattr(self, f"b_o{i}"))
        return x


def make_inputs(seqs, gen, tokens_per_block=16, num_blocks=32):
    positions, slots, tables = [], [], torch.zeros(len(seqs), 4, dtype=torch.int32)
    next_block = 3  # leave blocks 0..2 untouched
    for b, (num_cached, num_new) in enumerate(seqs):
        nblk = -(-(num_cached + num_new) // tokens_per_block)
        tables[b, :nblk] = torch.arange(next_block, next_block + 2 * nblk, 2, dtype=torch.int32)  # non-contiguous
        next_block += 2 * nblk
        for p in range(num_cached, num_cached + num_new):
            positions.append(p)
            slots.append(int(tables[b, p // tokens_per_block]) * tokens_per_block + p % tokens_per_block)
    new = torch.tensor([n for _, n in seqs])
    return (torch.randn(len(positions), HIDDEN, generator=gen), torch.tensor(positions),
            torch.cat([torch.zeros(1, dtype=torch.long), new.cumsum(0)]).to(torch.int32),
            torch.tensor([c + n for c, n in seqs], dtype=torch.int32), tables, torch.tensor(slots),
            torch.randn(NUM_LAYERS, 2, num_blocks, tokens_per_block, NUM_KV_HEADS, HEAD_DIM, generator=gen))


def test_ops_compile_with_aot_inductor_and_mutate_pool_in_place(tmp_path):
    gen = torch.Generator().manual_seed(0)
    model = ToyAttentionNet(gen).eval()
    example = make_inputs([(0, 7), (12, 1)], gen)
    num_tokens = torch.export.Dim("num_tokens", min=2, max=256)
    num_seqs = torch.export.Dim("num_seqs", min=1, max=16)
    dynamic_shapes = ({0: num_tokens}, {0: num_tokens}, {0: num_seqs + 1}, {0: num_seqs}, {0: num_seqs},
                      {0: num_tokens}, None)
    with torch.no_grad():
        exported = torch.export.export(model, example, dynamic_shapes=dynamic_shapes)
        package_path = torch._inductor.aoti_compile_and_package(exported, package_path=str(tmp_path / "toy.pt2"))
    compiled = torch._inductor.aoti_load_package(package_path)

    for seqs in ([(0, 7), (12, 1)], [(30, 1), (5, 20), (0, 3)]):  # the export example, then other shapes
        inputs = make_inputs(seqs, gen)
        pool = inputs[-1]
        pool_before, pool_eager = pool.clone(), pool.clone()
        data_ptr = pool.data_ptr()
        with torch.no_grad():
            expected = model(*inputs[:-1], pool_eager)
            out = compiled(*inputs)
        torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-5)
        # The package wrote this step's K/V into the very tensor it was given, as eager did.
        assert pool.data_ptr() == data_ptr
        assert not torch.equal(pool, pool_before)
        torch.testing.assert_close(pool, pool_eager, atol=1e-5, rtol=1e-5)
