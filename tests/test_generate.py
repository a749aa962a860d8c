"""``generate`` means what HF's ``generate`` means: streamers, generation configs, processors.

Streamers follow HF's protocol (the prompt first, then each group of new tokens, then ``end()``)
on every backend; the tokens streamed are the tokens returned.
"""

from __future__ import annotations

import threading

import pytest
import torch
from transformers import AutoTokenizer, TextIteratorStreamer

from leapfx import rewrite
from leapfx.bench import REFERENCE_MODEL
from tests.conftest import tiny_model

PROMPT = torch.tensor([[72, 101, 108, 108, 111, 32, 119]])


class RecordingStreamer:
    """Records what HF's streamer protocol hands over: ``put`` tensors, then one ``end``."""

    def __init__(self) -> None:
        self.puts: list[torch.Tensor] = []
        self.ended = 0

    def put(self, value: torch.Tensor) -> None:
        assert self.ended == 0, "put after end"
        self.puts.append(value.clone())

    def end(self) -> None:
        self.ended += 1

    def new_tokens(self) -> list[int]:
        return [t for value in self.puts[1:] for t in value.reshape(-1).tolist()]


@pytest.fixture(scope="module")
def byte_model():
    return tiny_model("llama", layers=4, vocab=259, seed=7)


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(REFERENCE_MODEL)


def _streamed(generate, prompt, **kwargs) -> tuple[torch.Tensor, RecordingStreamer]:
    streamer = RecordingStreamer()
    out = generate(prompt, streamer=streamer, **kwargs)
    return out, streamer


@pytest.mark.parametrize(
    "recipe, options",
    [("autoregressive", {}), ("layerskip", {"exit_layer": 2, "num_speculations": 3}),
     ("early_exit", {"exit_layer": 2})],
)  # fmt: skip
def test_streamer_gets_prompt_then_every_new_token_then_end(byte_model, recipe, options):
    sm = rewrite.apply(byte_model, recipe, **options)
    out, streamer = _streamed(sm.generate, PROMPT, max_new_tokens=17)
    assert torch.equal(streamer.puts[0], PROMPT)  # the prompt first, as HF does
    assert streamer.puts[0].device.type == "cpu"
    assert all(v.dim() in (1, 2) for v in streamer.puts)
    assert streamer.new_tokens() == out[0, PROMPT.shape[1] :].tolist()
    assert streamer.ended == 1
    if recipe == "layerskip" and sm.last_metrics.accepted_per_verify:
        # accepted drafts come as one group per round (more than one token at once)
        assert len(streamer.puts) - 1 < out.shape[1] - PROMPT.shape[1]


def test_text_iterator_streamer_text_equals_decoded_output(byte_model, tokenizer):
    sm = rewrite.apply(byte_model, "layerskip", exit_layer=1, num_speculations=4)
    streamer = TextIteratorStreamer(tokenizer, skip_prompt=True)
    result = {}

    def run():
        result["out"] = sm.generate(PROMPT, max_new_tokens=24, streamer=streamer)

    thread = threading.Thread(target=run)
    thread.start()
    text = "".join(streamer)
    thread.join()
    new = result["out"][0, PROMPT.shape[1] :]
    assert text == tokenizer.decode(new)


def test_streamer_stops_at_eos(byte_model):
    sm = rewrite.apply(byte_model, "layerskip", exit_layer=2, num_speculations=4)
    free = sm.generate(PROMPT, max_new_tokens=12)
    eos = int(free[0, PROMPT.shape[1] + 5])
    out, streamer = _streamed(sm.generate, PROMPT, max_new_tokens=12, eos_token_id=eos)
    assert out[0, -1] == eos
    assert streamer.new_tokens() == out[0, PROMPT.shape[1] :].tolist()


def test_onnx_streamer(byte_model, tmp_path):
    pytest.importorskip("onnxruntime")
    pytest.importorskip("onnxscript")
    from leapfx.export import OnnxModel

    model = tiny_model("llama", layers=2, vocab=64, seed=3)
    prompt = torch.tensor([[5, 9, 1, 33]])
    sm = rewrite.apply(model, "layerskip", exit_layer=1, num_speculations=3)
    sm.export_onnx(tmp_path / "onnx")
    ort_model = OnnxModel(tmp_path / "onnx")
    out, streamer = _streamed(ort_model.generate, prompt, max_new_tokens=10)
    assert torch.equal(streamer.puts[0], prompt)
    assert streamer.new_tokens() == out[0, prompt.shape[1] :].tolist()
    assert streamer.ended == 1
