"""The suite's ONNX stage memo (``tests/onnx_memo.py``) shares an export only between stages
that are the same in everything the exporter reads: its key changes with the weights, a tie,
the model config, the graph code, the example inputs, the exporter's arguments and the file."""

from __future__ import annotations

import copy

import torch
from onnx_memo import stage_key
from torch import fx

from tests.conftest import tiny_model

ARGS = (torch.tensor([[1, 2, 3]]),)


def key(module, args=ARGS, name="full.onnx", **kwargs):
    return stage_key(module, args, name, opset=23, **kwargs)


def test_the_same_stage_has_the_same_key():
    assert key(tiny_model("llama", layers=1)) == key(tiny_model("llama", layers=1))


def test_anything_the_export_reads_changes_the_key():
    model = tiny_model("llama", layers=1)
    base = key(model)
    assert key(tiny_model("llama", layers=1, seed=1)) != base  # other weights
    bumped = copy.deepcopy(model)
    with torch.no_grad():
        bumped.model.norm.weight[0] += 1e-6  # one element of one weight
    assert key(bumped) != base
    tied = copy.deepcopy(model)
    tied.lm_head.weight = tied.model.embed_tokens.weight  # a tie the exporter shares
    untied = copy.deepcopy(tied)
    untied.lm_head.weight = torch.nn.Parameter(tied.lm_head.weight.detach().clone())
    assert key(tied) != key(untied)  # the same values, one tensor or two
    config = copy.deepcopy(model)
    config.config.rope_theta = 500.0  # read at run time, through the config
    assert key(config) != base
    attribute = copy.deepcopy(model)
    attribute.model.layers[0].self_attn.scaling = 0.5  # a plain attribute of a submodule
    assert key(attribute) != base
    assert key(model, args=(torch.tensor([[1, 2, 4]]),)) != base  # the example's values
    assert key(model, name="draft.onnx") != base  # its data file is named after it
    assert key(model, input_names=["ids"]) != key(model, input_names=["input_ids"])


def test_the_graph_code_changes_the_key():
    def twice(x):
        return x * 2

    def thrice(x):
        return x * 3

    a, b = fx.symbolic_trace(twice), fx.symbolic_trace(thrice)
    assert key(a) != key(b) and key(a) == key(fx.symbolic_trace(twice))
