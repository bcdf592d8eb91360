"""The decode attention kernel: each row's query heads over its own slot's first columns, equal
to torch's masked attention, a row's output the same whatever rows share the call, and the
engine's plan handing it the counts instead of a mask."""

import math

import pytest
import torch

from treegrpo_ray.actors.engines.slot_kv import SlotKV
from treegrpo_ray.kernels.decode_attention import load_kernel

KERNEL = load_kernel()
pytestmark = pytest.mark.skipif(KERNEL is None, reason="no AVX2 or no C compiler here")


def test_a_row_attends_its_columns_by_hand():
    # one row, one head, D = 8, two columns: scores 0 and ln 3 -> weights 1/4 and 3/4
    query = torch.zeros(1, 1, 1, 8)
    query[..., 0] = 1.0
    key = torch.zeros(1, 1, 5, 8)  # capacity 5: the columns past the count must not count
    key[0, 0, 1, 0] = math.log(3.0)
    key[0, 0, 2:, 0] = 100.0  # would take all the weight if read
    value = torch.stack([torch.full((8,), x) for x in (1.0, 5.0, 9.0, 9.0, 9.0)])[None, None]
    out = KERNEL.attend(query, key, value, torch.tensor([2]), scale=1.0)
    torch.testing.assert_close(out, torch.full((1, 1, 1, 8), 0.25 * 1.0 + 0.75 * 5.0))


@pytest.mark.parametrize(("group", "dim"), [(3, 64), (1, 24), (2, 40)])  # 24, 40: 8-wide tails
def test_the_kernel_equals_torchs_masked_attention(group, dim):
    generator = torch.Generator().manual_seed(group * dim)
    rows, kv_heads, capacity = 5, 2, 37
    query = torch.randn(rows, kv_heads, group, dim, generator=generator)
    key = torch.randn(rows + 1, kv_heads, capacity, dim, generator=generator)  # a spare slot
    value = torch.randn(rows + 1, kv_heads, capacity, dim, generator=generator)
    counts = torch.tensor([1, 37, 9, 4, 20])  # 1: a row attending itself only; 37: all
    hidden = torch.arange(capacity) >= counts[:, None]
    mask = torch.zeros(hidden.shape).masked_fill_(hidden, float("-inf"))[:, None, None]
    expected = torch.nn.functional.scaled_dot_product_attention(
        query, key[:rows], value[:rows], attn_mask=mask, scale=0.3
    )
    got = KERNEL.attend(query, key, value, counts, scale=0.3)
    torch.testing.assert_close(got, expected, atol=2e-6, rtol=2e-5)


def test_a_rows_output_does_not_depend_on_the_rows_beside_it():
    generator = torch.Generator().manual_seed(7)
    query = torch.randn(4, 3, 3, 64, generator=generator)
    key = torch.randn(4, 3, 50, 64, generator=generator)
    value = torch.randn(4, 3, 50, 64, generator=generator)
    counts = torch.tensor([50, 3, 17, 8])
    together = KERNEL.attend(query, key, value, counts, scale=0.125)
    for row in range(4):
        alone = KERNEL.attend(
            query[row : row + 1],
            key[row : row + 1],
            value[row : row + 1],
            counts[row : row + 1],
            0.125,
        )
        assert torch.equal(alone[0], together[row])  # bit for bit


def test_with_the_kernel_the_plan_hands_it_each_rows_count_instead_of_a_mask():
    cpu = torch.device("cpu")
    kv = SlotKV(
        layers=1, kv_heads=1, head_dim=8, dtype=torch.float32, device=cpu, decode_kernel=KERNEL
    )
    kv.reserve(3, 16)
    _, plan = kv.begin(torch.tensor([4, 9, 2]), torch.tensor([1, 1, 3]), decoding=2)
    assert plan.decode_kernel is KERNEL and plan.decode_mask is None
    assert plan.decode_counts.tolist() == [5, 10]  # columns 0..4 and 0..9, each its new token's
    assert len(plan.joining) == 1 and plan.joining[0].mask is not None  # prefill: torch's path
    odd = SlotKV(
        layers=1, kv_heads=1, head_dim=6, dtype=torch.float32, device=cpu, decode_kernel=KERNEL
    )  # a head dim the kernel cannot take
    assert odd.decode_kernel is None


def test_query_rows_read_the_slots_they_are_given():
    # a joining row's prefix: its tokens are query rows of one slot, each over the columns up to
    # its own (causal), beside a decoding row of another slot
    generator = torch.Generator().manual_seed(11)
    kv_heads, group, dim, capacity = 2, 3, 16, 12
    key = torch.randn(3, kv_heads, capacity, dim, generator=generator)
    value = torch.randn(3, kv_heads, capacity, dim, generator=generator)
    query = torch.randn(5, kv_heads, group, dim, generator=generator)
    slots, counts = torch.tensor([0, 2, 2, 2, 2]), torch.tensor([7, 5, 6, 7, 8])
    got = KERNEL.attend(query, key, value, counts, 0.25, slots)
    for row, (slot, count) in enumerate(zip(slots.tolist(), counts.tolist(), strict=True)):
        expected = torch.nn.functional.scaled_dot_product_attention(
            query[row : row + 1],
            key[slot : slot + 1, :, :count],
            value[slot : slot + 1, :, :count],
            scale=0.25,
        )
        torch.testing.assert_close(got[row], expected[0], atol=2e-6, rtol=2e-5)
