"""The decoder's small operations in one kernel call each: the residual add with the RMS norm, the
rotary embedding with the KV write, SiLU(gate) * up; by hand, against transformers' own
functions, and a row's results the same whatever rows share the call."""

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb

from treegrpo_ray.kernels.decoder_ops import load_kernel

KERNEL = load_kernel()
pytestmark = pytest.mark.skipif(KERNEL is None, reason="no AVX2 or no C compiler here")


def test_the_norm_adds_into_the_residual_then_normalises_by_hand():
    residual = torch.tensor([[1.0, 1.0, 1.0, 1.0], [2.0, 0.0, 0.0, 0.0]])
    added = torch.tensor([[2.0, 2.0, 2.0, 2.0], [0.0, 0.0, 0.0, 0.0]])
    weight = torch.tensor([1.0, 2.0, 3.0, 4.0])
    out = KERNEL.add_rms_norm(residual, added, weight, eps=0.0)
    # row 0: 3s, rms 3 -> the weight; row 1: (2, 0, 0, 0), rms sqrt(4 / 4) = 1
    torch.testing.assert_close(residual, torch.tensor([[3.0] * 4, [2.0, 0.0, 0.0, 0.0]]))
    torch.testing.assert_close(out, torch.tensor([[1.0, 2.0, 3.0, 4.0], [2.0, 0.0, 0.0, 0.0]]))


@pytest.mark.parametrize(("rows", "hidden"), [(5, 576), (5, 20), (40, 64)])  # 20: 8-wide tail
def test_the_norm_equals_llamas_rms_norm(rows, hidden):
    generator = torch.Generator().manual_seed(hidden)
    residual = torch.randn(rows, hidden, generator=generator)
    added = torch.randn(rows, hidden, generator=generator)
    norm = LlamaRMSNorm(hidden, eps=1e-5)
    norm.weight.data = torch.randn(hidden, generator=generator)
    expected_residual = residual + added
    with torch.no_grad():
        expected = norm(expected_residual)
    out = KERNEL.add_rms_norm(residual, added, norm.weight.detach(), 1e-5)
    assert torch.equal(residual, expected_residual)
    torch.testing.assert_close(out, expected, atol=1e-6, rtol=1e-5)
    alone = KERNEL.add_rms_norm(expected_residual.clone(), None, norm.weight.detach(), 1e-5)
    assert torch.equal(alone, out)


def test_rotary_store_rotates_and_writes_by_hand():
    # D = 2, one query head and one KV head: cos 0, sin 1 turns (x, y) into (-y, x)
    qkv = torch.tensor([[1.0, 2.0, 3.0, 4.0, 5.0, 6.0]])  # q (1, 2), k (3, 4), v (5, 6)
    cos, sin = torch.zeros(1, 2), torch.ones(1, 2)
    keys, values = torch.zeros(2, 1, 4, 2), torch.zeros(2, 1, 4, 2)
    query = KERNEL.rotary_store(qkv, cos, sin, torch.tensor([2]), keys, values)
    assert query.tolist() == [[[[-2.0, 1.0]]]]
    expected_keys, expected_values = torch.zeros(2, 1, 4, 2), torch.zeros(2, 1, 4, 2)
    expected_keys[0, 0, 2] = torch.tensor([-4.0, 3.0])
    expected_values[0, 0, 2] = torch.tensor([5.0, 6.0])
    assert torch.equal(keys, expected_keys) and torch.equal(values, expected_values)


def test_rotary_store_equals_transformers_rotary_embedding():
    generator = torch.Generator().manual_seed(3)
    rows, heads, kv_heads, dim, capacity = 4, 9, 3, 64, 30
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * dim, generator=generator)
    angles = torch.rand(rows, dim // 2, generator=generator) * 6
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()
    columns = torch.tensor([0, 29, 7, 7])
    keys = torch.randn(rows + 1, kv_heads, capacity, dim, generator=generator)
    values = torch.randn(rows + 1, kv_heads, capacity, dim, generator=generator)
    expected_keys, expected_values = keys.clone(), values.clone()
    query = KERNEL.rotary_store(qkv, cos, sin, columns, keys, values)

    q, k, v = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    q_rotated, k_rotated = apply_rotary_pos_emb(
        q.view(rows, heads, dim), k.view(rows, kv_heads, dim), cos, sin, unsqueeze_dim=1
    )
    for row, column in enumerate(columns.tolist()):
        expected_keys[row, :, column] = k_rotated[row]
        expected_values[row, :, column] = v[row].view(kv_heads, dim)
    torch.testing.assert_close(query.view(rows, heads, dim), q_rotated, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(keys, expected_keys, atol=1e-6, rtol=1e-6)
    assert torch.equal(values, expected_values)


def test_rotary_store_writes_each_row_into_the_slot_it_is_given():
    # three tokens of the row in slot 1 at columns 4..6 (a joining row's prefix), one of slot 0
    dim, generator = 8, torch.Generator().manual_seed(4)
    qkv = torch.randn(4, 3 * dim, generator=generator)  # one query head, one KV head
    cos, sin = torch.ones(4, dim), torch.zeros(4, dim)  # no rotation
    keys, values = torch.zeros(2, 1, 8, dim), torch.zeros(2, 1, 8, dim)
    columns, slots = torch.tensor([2, 4, 5, 6]), torch.tensor([0, 1, 1, 1])
    query = KERNEL.rotary_store(qkv, cos, sin, columns, keys, values, slots)
    assert torch.equal(query.view(4, dim), qkv[:, :dim])
    written = keys[slots, 0, columns], values[slots, 0, columns]
    assert torch.equal(written[0], qkv[:, dim : 2 * dim])
    assert torch.equal(written[1], qkv[:, 2 * dim :])
    assert int((keys != 0).sum()) == int((values != 0).sum()) == 4 * dim  # nothing else


@pytest.mark.parametrize("rows", [3, 40])  # 40: the rows split between threads
def test_silu_mul_by_hand_and_against_torch(rows):
    gate_up = torch.tensor([[0.0, 100.0, -100.0, 2.0, 3.0, 1.0]])  # gates 0, 100, -100
    out = KERNEL.silu_mul(gate_up)
    torch.testing.assert_close(out, torch.tensor([[0.0, 300.0, -0.0]]), atol=1e-30, rtol=1e-6)

    generator = torch.Generator().manual_seed(5)
    gate_up = torch.randn(rows, 2 * 1540, generator=generator) * 4  # 1540: an 8-wide tail
    gate, up = gate_up.chunk(2, dim=-1)
    expected = torch.nn.functional.silu(gate) * up
    torch.testing.assert_close(KERNEL.silu_mul(gate_up), expected, atol=1e-6, rtol=1e-5)
    assert torch.equal(KERNEL.silu_mul(gate_up[2:3]), KERNEL.silu_mul(gate_up)[2:3])
