"""The llama_cpp rows' plumbing without llama-cpp-python: a stand-in Llama, the rows' place,
their agreement and load fields, and the skip (with the install command) when it is absent;
``--weights`` and the load fields of ``leapfx bench --json``."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from leapfx.bench import llamacpp
from leapfx.bench.harness import BenchConfig, run_bench
from leapfx.cli import main
from tests.conftest import tiny_model


class FakeLlama:
    """llama-cpp-python's ``Llama`` as the rows use it: reset() and a greedy generate()."""

    made: list = []

    def __init__(self, path, threads, lookup):
        self.path, self.threads, self.lookup = path, threads, lookup
        self.resets = 0
        FakeLlama.made.append(self)

    def reset(self):
        self.resets += 1

    def generate(self, tokens, *, top_k, temp, repeat_penalty, reset):
        assert (top_k, temp, reset) == (1, 0.0, True)
        t = tokens[-1]
        while True:  # a deterministic continuation: +1 each step
            t = (t + 1) % 100
            yield t


@pytest.fixture
def fake_llama(monkeypatch):
    FakeLlama.made = []
    monkeypatch.setattr(llamacpp, "available", lambda: True)
    monkeypatch.setattr(llamacpp, "_default_factory", FakeLlama)
    return FakeLlama


def test_llama_cpp_rows_run_beside_ours(fake_llama):
    model = tiny_model("llama", layers=2, vocab=100, eos=7)
    prompts = [torch.tensor([[1, 2, 3, 4]]), torch.tensor([[10, 11]])]
    config = BenchConfig(recipe="lookup", max_new_tokens=6, repeats=1, llama_cpp="model.gguf")
    rows = run_bench(model, prompts, config, progress=False)
    by = {r.system: r for r in rows}
    assert [r.system for r in rows][4:6] == ["llama_cpp", "llama_cpp_lookup"]
    for name in ("llama_cpp", "llama_cpp_lookup"):
        row = by[name]
        assert row.identical_to_greedy is None  # 8-bit activations: agreement, not identity
        assert 0.0 <= row.agreement_with_greedy <= 1.0
        assert row.extra["threads"] == torch.get_num_threads()
        assert set(row.extra["load"]) == {"seconds", "seconds_cached", "resident_bytes"}
    assert by["llama_cpp_lookup"].extra["lookup_tokens"] == llamacpp.LOOKUP_TOKENS
    # the first prompt's continuation stops at eos (7) like HF's: 4 -> 5, 6, 7
    assert by["llama_cpp"].extra["first_new_tokens"] == [5, 6, 7]
    used = [m for m in fake_llama.made if m.resets]
    assert used and all(m.path == "model.gguf" for m in used)
    assert sorted({m.lookup for m in used}) == [False, True]


def test_llama_cpp_rows_skipped_without_the_package(monkeypatch, caplog):
    monkeypatch.setattr(llamacpp, "available", lambda: False)
    model = tiny_model("llama", layers=2, vocab=100)
    config = BenchConfig(recipe="lookup", max_new_tokens=3, repeats=1, llama_cpp="model.gguf")
    with caplog.at_level(logging.WARNING):
        rows = run_bench(model, [torch.tensor([[1, 2]])], config, progress=False)
    assert not any(r.system.startswith("llama_cpp") for r in rows)
    assert ".[llamacpp]" in caplog.text


def test_bench_cli_weights_and_load_fields(tmp_path, fake_llama, capsys):
    """A GGUF model in the CLI: --weights, the llama.cpp rows and every row's load."""
    from tests.gguf_writer import vocabulary, write_tiny_llama_gguf

    pytest.importorskip("gguf")
    path = tmp_path / "tiny-q4.gguf"
    write_tiny_llama_gguf(path, tiny_model("llama", layers=2, vocab=len(vocabulary()), tie=True,
                                           eos=2, seed=4), quantized=True)  # fmt: skip
    out = tmp_path / "bench.json"
    args = ["bench", "--model", str(path), "--recipe", "lookup", "--prompt-set", "stdlib",
            "--prompts", "1", "--max-new-tokens", "4", "--repeats", "1", "--warmup", "0",
            "--json", str(out), "--quiet"]  # fmt: skip
    assert main(args) == 0
    data = json.loads(out.read_text())
    assert data[0]["run"]["weights"] == "native"
    rows = {r["system"]: r for r in data}
    assert {"llama_cpp", "llama_cpp_lookup", "leapfx_autoregressive"} <= set(rows)
    load = rows["leapfx_autoregressive"]["extra"]["load"]
    assert load["weights"] == "native" and load["seconds"] > 0 and "seconds_cached" in load
    assert "loaded in" in capsys.readouterr().out
    assert main([*args[:-1], "--weights", "float32", "--no-llama-cpp", "--quiet"]) == 0
    data = json.loads(out.read_text())
    assert data[0]["run"]["weights"] == "float32"
    assert not any(r["system"].startswith("llama_cpp") for r in data)
