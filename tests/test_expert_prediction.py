"""M2R2 sec. 2.3.3: expert prediction from the accelerated residual, on a tiny Mixtral/OLMoE
(HF modules directly: capture does not support MoE yet)."""

from __future__ import annotations

import pytest
import torch
import transformers

from leapfx.runtime.expert_prediction import predict_experts, predicted_layers


def _tiny_moe(kind: str):
    common = dict(
        vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=8,
        num_attention_heads=4, num_key_value_heads=2, num_experts_per_tok=2,
        max_position_embeddings=64,
    )  # fmt: skip
    torch.manual_seed(0)
    if kind == "mixtral":
        config = transformers.MixtralConfig(num_local_experts=6, **common)
        return transformers.MixtralForCausalLM(config).eval()
    config = transformers.OlmoeConfig(num_experts=6, **common)
    return transformers.OlmoeForCausalLM(config).eval()


def test_predicted_layers():
    assert predicted_layers(0, 8) == [2, 3]
    assert predicted_layers(2, 8) == [6, 7]
    assert predicted_layers(3, 8) == []
    with pytest.raises(ValueError, match="layer"):
        predicted_layers(8, 8)


@pytest.mark.parametrize("kind", ["mixtral", "olmoe"])
def test_predictions_have_the_right_shape_and_come_from_the_right_layers(kind):
    model = _tiny_moe(kind)
    state = torch.randn(1, 5, 32)
    predicted = predict_experts(model, state, layer=1)
    assert sorted(predicted) == [4, 5]
    for idx in predicted.values():
        assert idx.shape == (1, 5, 2) and idx.dtype == torch.long
        assert int(idx.min()) >= 0 and int(idx.max()) < 6
    # A state equal to the residual layer L's router actually reads gives exactly its routing.
    ids = torch.randint(0, 64, (1, 5))
    seen = {}

    def hook(module, args, kwargs, output, layer=None):
        seen[layer] = output[2].reshape(1, 5, 2)

    def grab(layer):
        return lambda m, a, k, o: hook(m, a, k, o, layer)

    inputs = {}
    for target in (4, 5):
        layers = model.model.layers
        layers[target].mlp.gate.register_forward_hook(grab(target), with_kwargs=True)
        norm = layers[target].post_attention_layernorm
        norm.register_forward_hook(lambda m, a, o, t=target: inputs.__setitem__(t, a[0]))
    with torch.no_grad():
        model(ids)
    for target in (4, 5):
        got = predict_experts(model, inputs[target], layer=1)[target]
        assert torch.equal(got, seen[target])
    with pytest.raises(ValueError, match="fast_state"):
        predict_experts(model, torch.randn(5, 32), layer=1)
