"""oneDNN-packed linear layers: the model's own function, computed from the packed copies, and
for frozen layers the same input gradients."""

import pytest
import torch

from treegrpo_ray.config import LoraSettings, TinyModelConfig
from treegrpo_ray.learners.learner import with_lora_adapter
from treegrpo_ray.modeling import build_tiny_model
from treegrpo_ray.onednn_linear import OneDNNLinears, onednn_available

pytestmark = pytest.mark.skipif(
    not onednn_available(torch.device("cpu")), reason="torch built without oneDNN"
)


def _model_and_ids():
    model = build_tiny_model(TinyModelConfig(), vocab_size=40, seed=3).eval()
    ids = torch.randint(0, 40, (3, 7), generator=torch.Generator().manual_seed(0))
    return model, ids


@torch.inference_mode()
def test_packed_layers_compute_the_model_from_their_copy_of_the_weights():
    model, ids = _model_and_ids()
    expected = model(ids).logits
    packed = OneDNNLinears(model, batch_hint=3)
    assert len(packed.forwards) == sum(type(m) is torch.nn.Linear for m in model.modules())
    assert len(packed.groups) == 2 * model.config.num_hidden_layers  # q, k, v; gate, up
    for layer in packed.forwards:
        if layer is not model.get_output_embeddings():  # tied to the input embedding
            layer.weight.zero_()  # the model's own weights no longer give its function
    with packed.active():
        got = model(ids).logits
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(model(ids).logits, expected)  # outside: the (zeroed) own weights


def _adapter_gradients(model, ids):
    model.zero_grad(set_to_none=True)
    logits = model(ids).logits
    (logits.log_softmax(-1)[..., 5] * torch.arange(7.0)).sum().backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


def test_a_lora_policy_gets_the_same_adapter_gradients_through_its_packed_frozen_layers(
    nonzero_lora_b,
):
    model, ids = _model_and_ids()
    model = with_lora_adapter(model, LoraSettings(enabled=True, rank=4, alpha=8))
    nonzero_lora_b(model, seed=1)  # as trained: a zero B would leave its input grads untested
    expected = _adapter_gradients(model, ids)
    packed = OneDNNLinears(model, gradients=True)
    adapters = [m for m in model.modules() if type(m) is torch.nn.Linear and m.weight.requires_grad]
    assert adapters and not set(adapters) & set(packed.frozen)  # they keep torch's path
    assert len(packed.frozen) == 4 * 2 + 3 * 2 + 1  # attention, MLP base layers; LM head
    with packed.active():
        got = _adapter_gradients(model, ids)
    assert got.keys() == expected.keys()
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], atol=1e-5, rtol=1e-4)


@torch.inference_mode()
def test_a_merged_adapter_skips_its_wrappers_and_an_unmerged_one_keeps_them(nonzero_lora_b):
    """Inference through a merged LoRA policy calls the packed layers in place of peft's
    wrappers (their base layers hold the merged weights); an unmerged adapter adds its own
    term, so its wrappers keep their forward. Both give the policy's own logits."""
    model, ids = _model_and_ids()
    model = with_lora_adapter(model, LoraSettings(enabled=True, rank=4, alpha=8))
    nonzero_lora_b(model, seed=1)
    wrappers = [m for m in model.modules() if hasattr(m, "base_layer")]
    for merged in (False, True):
        if merged:
            model.merge_adapter()
        expected = model(ids).logits
        packed = OneDNNLinears(model, batch_hint=3)
        with packed.active():
            got = model(ids).logits
            overridden = ["forward" in vars(w) for w in wrappers]
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
        assert overridden == [merged] * len(wrappers) and len(wrappers) == 7 * 2
        assert not any("forward" in vars(w) for w in wrappers)  # restored on leaving
