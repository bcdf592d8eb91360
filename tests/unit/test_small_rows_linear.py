"""The small-rows linear kernel: x @ W.T + b at 1-32 rows from its blocked copy, each row's
outputs the same whatever rows share the call, chosen by the packed layers for forwards of at
most 32 rows, and off (None, said why) where it cannot be built."""

import logging

import pytest
import torch

from treegrpo_ray import kernels
from treegrpo_ray.config import TinyModelConfig
from treegrpo_ray.kernels.small_rows_linear import MOST_ROWS, load_kernel
from treegrpo_ray.modeling import build_tiny_model
from treegrpo_ray.onednn_linear import OneDNNLinears, onednn_available

KERNEL = load_kernel()
needs_kernel = pytest.mark.skipif(KERNEL is None, reason="no AVX2 or no C compiler here")


def _weights(out_features, in_features, seed=0):
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(out_features, in_features, generator=generator) / in_features**0.5
    return weight, torch.randn(out_features, generator=generator)


@needs_kernel
@pytest.mark.parametrize("rows", [1, 3, 6, 7, 13, 32])
@pytest.mark.parametrize("in_features", [40, 600])  # 600: more than one 256-input chunk
def test_the_kernel_computes_the_linear_layer(rows, in_features):
    weight, bias = _weights(48, in_features)
    x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(1))
    blocked = KERNEL.block(weight)
    assert blocked.shape == (3, in_features, 16)
    torch.testing.assert_close(KERNEL.linear(x, blocked, bias), x @ weight.T + bias)
    torch.testing.assert_close(KERNEL.linear(x, blocked, None), x @ weight.T)


@needs_kernel
def test_a_rows_outputs_do_not_depend_on_the_rows_beside_it():
    weight, bias = _weights(64, 600)
    x = torch.randn(2, 8, 600, generator=torch.Generator().manual_seed(2))  # 16 rows, two tiles
    blocked = KERNEL.block(weight)
    together = KERNEL.linear(x, blocked, bias)
    assert together.shape == (2, 8, 64)
    for i, j in [(0, 0), (0, 5), (1, 7)]:
        alone = KERNEL.linear(x[i, j : j + 1], blocked, bias)
        assert torch.equal(alone[0], together[i, j])  # bit for bit


@needs_kernel
@pytest.mark.skipif(not onednn_available(torch.device("cpu")), reason="torch without oneDNN")
@torch.inference_mode()
def test_packed_layers_take_the_kernel_at_most_32_rows_and_onednn_above():
    """With oneDNN's copies zeroed, only the kernel's blocked copies give the model's function:
    a forward of 32 tokens still computes it, one of 40 no longer does."""
    model = build_tiny_model(TinyModelConfig(), vocab_size=48, seed=3).eval()
    ids = torch.randint(0, 48, (5, 8), generator=torch.Generator().manual_seed(0))
    few = ids[:4]
    assert few.numel() <= MOST_ROWS < ids.numel()
    expected_few, expected_many = model(few).logits, model(ids).logits
    packed = OneDNNLinears(model, batch_hint=5, small_rows=KERNEL)
    linears = {forward for forward in packed.forwards.values() if hasattr(forward, "packed")}
    linears |= {group.linear for group in packed.groups.values()}
    assert all(linear.blocked is not None for linear in linears)  # every shape here blocks
    for linear in linears:
        linear.packed = torch.ops.mkldnn._reorder_linear_weight(
            torch.zeros(linear.blocked.shape[0] * 16, linear.blocked.shape[1]), 5
        )
    with packed.active():
        got_few, got_many = model(few).logits, model(ids).logits
    torch.testing.assert_close(got_few, expected_few, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(got_many, expected_many, atol=1e-2)


def test_without_a_compiler_the_kernel_is_off_and_says_why(monkeypatch, caplog):
    monkeypatch.setenv("CC", "no-such-compiler")
    with caplog.at_level(logging.WARNING):
        assert kernels.load_library.__wrapped__("small_rows_linear") is None
    if torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512"):
        assert "no C compiler" in caplog.text


def test_a_failed_build_turns_the_kernel_off_and_says_why(monkeypatch, tmp_path, caplog):
    monkeypatch.setattr(kernels, "KERNEL_DIR", tmp_path)  # nothing built there yet
    monkeypatch.setenv("CC", "false")  # a compiler that always fails
    with caplog.at_level(logging.WARNING):
        assert kernels.load_library.__wrapped__("small_rows_linear") is None
    if torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512"):
        assert "build failed" in caplog.text
        assert list(tmp_path.iterdir()) == []  # no half-written library left
