"""oneDNN-packed linear layers: the same function as the model's own, computed from the copy."""

import pytest
import torch

from treegrpo_ray.actors.engines.packed_linear import PackedLinears, onednn_available
from treegrpo_ray.modeling import TinyModelConfig, build_tiny_model

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
    packed = PackedLinears(model, batch_hint=3)
    assert len(packed.packed) == sum(type(m) is torch.nn.Linear for m in model.modules())
    for layer in packed.packed:
        if layer is not model.get_output_embeddings():  # tied to the input embedding
            layer.weight.zero_()  # the model's own weights no longer give its function
    with packed.active():
        got = model(ids).logits
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(model(ids).logits, expected)  # outside: the (zeroed) own weights
