"""Training drafters for any model: ``leapfx train-eagle|train-kangaroo|train-m2r2|train-specee``.

Where files go (``--out`` required but for a shipped model's own parts, never inside the
package), ``--data`` sources, the self-generated data's benchmark filter (over the generator's
output), cached teacher features, and resume == uninterrupted (same seed, same parts).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from leapfx.bench.prompt_sets import CHAT_PROMPTS, benchmark_texts, humaneval_prompts
from leapfx.cli import main
from leapfx.models import REFERENCE_MODEL
from leapfx.runs.drafters import PACKAGE
from leapfx.train.data import byte_tokenizer
from leapfx.train.features import cached_features
from leapfx.train.self_data import BenchmarkFilter, self_pairs
from leapfx.train.sources import training_data
from tests.conftest import tiny_model

COMMANDS = ("train-eagle", "train-kangaroo", "train-m2r2", "train-specee")
PARTS_JSON = {"eagle": "eagle_head.json", "kangaroo": "adapter.json"}
TEXT = "".join(f"def f{i}(x):\n    return x * {i} + {i % 7}\n\n" for i in range(120))


@pytest.fixture
def checkpoint(tmp_path) -> Path:
    """A tiny byte-level Llama saved as a HF checkpoint folder (with its tokenizer)."""
    tok = byte_tokenizer()
    model = tiny_model("llama", layers=3, vocab=len(tok), eos=tok.eos_token_id, seed=3)
    model.save_pretrained(tmp_path / "ckpt")
    tok.save_pretrained(tmp_path / "ckpt")
    return tmp_path / "ckpt"


@pytest.fixture
def corpus(tmp_path) -> Path:
    path = tmp_path / "corpus.txt"
    path.write_text(TEXT)
    return path


def _package_files() -> set[Path]:
    return {p for p in PACKAGE.rglob("*") if "__pycache__" not in p.parts}


@pytest.mark.parametrize("command", COMMANDS)
def test_commands_require_out_for_other_models(command, checkpoint, capsys):
    before = _package_files()
    assert main([command, "--model", str(checkpoint), "--seed", "0"]) == 2
    err = capsys.readouterr().err
    assert f"--out: required for --model {str(checkpoint)!r}" in err
    assert _package_files() == before


@pytest.mark.parametrize("command", COMMANDS)
def test_commands_refuse_to_write_into_the_package(command, checkpoint, capsys):
    before = _package_files()
    for model in (["--model", str(checkpoint)], []):  # any model, the reference included
        for out in (PACKAGE / "parts", REFERENCE_MODEL.parent / "mine"):
            assert main([command, *model, "--out", str(out), "--seed", "0"]) == 2
            assert "lies inside the installed package" in capsys.readouterr().err
    # another model may not write into the reference model's asset folder either
    target = REFERENCE_MODEL / "eagle"
    assert main([command, "--model", str(checkpoint), "--out", str(target)]) == 2
    assert "lies inside the installed package" in capsys.readouterr().err
    assert _package_files() == before


def test_the_reference_models_own_parts_keep_their_default_place():
    """The documented regeneration of the shipped parts (--out omitted, or naming them)."""
    from leapfx.runs.drafters import check_out

    eagle = REFERENCE_MODEL / "eagle"
    assert check_out(None, None, shipped=eagle) == eagle
    assert check_out(str(eagle), "reference", shipped=eagle) == eagle
    m2r2_exit = REFERENCE_MODEL / "m2r2_exit"  # docs/training.md's train-m2r2 --recipe m2r2_exit
    assert check_out(str(m2r2_exit), None, shipped=REFERENCE_MODEL / "m2r2") == m2r2_exit


def _fake_generator(outputs: list[str], tok):
    """A ``complete`` that answers each prompt with the next of the given texts (the
    generator's output)."""
    queue = list(outputs)

    def complete(prompts, max_new_tokens, sample, generator):
        texts = [queue.pop(0) for _ in prompts]
        return [tok(t, add_special_tokens=False)["input_ids"] for t in texts]

    return complete


def test_self_data_never_holds_a_benchmark_prompt():
    tok = byte_tokenizer()
    humaneval = humaneval_prompts()
    outputs = [
        # round 1: two questions, the first a benchmark prompt (dropped); one answer
        CHAT_PROMPTS[3], "How do I boil an egg?", "Put it in boiling water for nine minutes.",
        # round 2: a benchmark prompt inside a longer question (dropped)
        "Please " + CHAT_PROMPTS[0].lower(),
        # round 3: an answer holding a HumanEval prompt (dropped)
        "Write a function.", "Sure:\n" + humaneval[5],
        # round 4: kept
        "What is a list?", "A list holds items in order.",
    ]  # fmt: skip
    data = self_pairs(None, tok, pairs=2, exclude=benchmark_texts(),
                      complete=_fake_generator(outputs, tok))  # fmt: skip
    assert [p["instruction"] for p in data.pairs] == ["How do I boil an egg?", "What is a list?"]
    assert data.dropped == 3
    guard = BenchmarkFilter.of(benchmark_texts())
    assert not any(guard.hits(f"{p['instruction']}\n{p['response']}") for p in data.pairs)
    # the check is the filter's, not luck: each benchmark prompt is caught verbatim
    assert all(guard.hits(p) for p in [*CHAT_PROMPTS, *humaneval])


def test_self_data_from_a_model_is_cached(checkpoint, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(checkpoint).eval()
    tok = AutoTokenizer.from_pretrained(checkpoint)
    from leapfx.train.sources import SelfDataOptions

    options = SelfDataOptions(pairs=3, instruction_tokens=6, response_tokens=24)
    kwargs = dict(cache_dir=tmp_path / "cache", exclude=benchmark_texts(), self_options=options,
                  held_out_tokens=16)  # fmt: skip
    first = training_data("self", model, tok, **kwargs)
    assert first.info["generation"]["pairs"] == 3
    again = training_data("self", model, tok, **kwargs)
    assert torch.equal(first.train, again.train) and torch.equal(first.held_out, again.held_out)
    assert len(list((tmp_path / "cache").glob("self-*.jsonl"))) == 1
    with pytest.raises(ValueError, match="exclude: --data self needs the benchmark prompts"):
        training_data("self", model, tok, cache_dir=tmp_path / "c2", self_options=options)


def test_data_file_kinds_and_errors(tmp_path):
    tok = byte_tokenizer()
    jsonl = tmp_path / "d.jsonl"
    jsonl.write_text('{"text": "abc def"}\n{"instruction": "hi", "response": "there"}\n')
    data = training_data(str(jsonl), None, tok, cache_dir=tmp_path)
    assert data.info["documents"] == 2 and data.train.numel() > 0 and data.held_out.numel() >= 2
    (tmp_path / "bad.jsonl").write_text('{"other": 1}\n')
    with pytest.raises(ValueError, match="allowed keys: text; messages"):
        training_data(str(tmp_path / "bad.jsonl"), None, tok, cache_dir=tmp_path)
    with pytest.raises(ValueError, match="--data: 'nowhere' is neither 'stdlib' nor 'self'"):
        training_data("nowhere", None, tok, cache_dir=tmp_path)


def test_teacher_features_are_cached_and_keyed(tmp_path):
    model = tiny_model("llama", layers=3, vocab=64, seed=1)
    tokens = torch.randint(0, 64, (300,), generator=torch.Generator().manual_seed(0))
    kw = dict(seq_len=16, windows=10, layers=(1, 3), cache_dir=tmp_path, key={"data": "x"})
    a = cached_features(model, tokens, **kw)
    b = cached_features(model, tokens, **kw)
    assert len(list(tmp_path.glob("features-*.safetensors"))) == 1
    assert torch.equal(a.states[3], b.states[3]) and a.tokens.shape == (10, 16)
    cached_features(model, tokens[1:], **kw)  # other data: another file
    assert len(list(tmp_path.glob("features-*.safetensors"))) == 2
    # the pre-norm last state the EAGLE trainer reads
    from leapfx import rewrite
    from leapfx.train.eagle import teacher_features

    h, _ = teacher_features(rewrite.apply(model, "eagle"), a.tokens[:2])
    torch.testing.assert_close(a.states[3][:2].float(), h, rtol=1e-3, atol=1e-3)


def _parts(path: Path, recipe: str) -> dict[str, torch.Tensor]:
    return load_file(
        str(path / ("eagle_head" if recipe == "eagle" else "adapter")) + ".safetensors"
    )


@pytest.mark.parametrize("recipe", ["eagle", "kangaroo"])
def test_resumed_run_gives_the_uninterrupted_runs_parts(recipe, checkpoint, corpus, tmp_path):
    common = [f"train-{recipe}", "--model", str(checkpoint), "--data", str(corpus),
              "--steps", "6", "--checkpoint-every", "2", "--batch-size", "2", "--seq-len", "32",
              "--features", "12", "--held-out-tokens", "64", "--cache-dir",
              str(tmp_path / "cache"), "--quiet", "--draft-vocab", "8"]  # fmt: skip
    assert main([*common, "--out", str(tmp_path / "whole")]) == 0
    # stopped by its clock after every step, then the same command again, then without a clock
    interrupted = [*common, "--out", str(tmp_path / "parts")]
    for steps in (1, 2):
        assert main([*interrupted, "--minutes", "1e-9"]) == 0
        meta = json.loads((tmp_path / "parts" / PARTS_JSON[recipe]).read_text())
        assert meta["training"][-1]["steps"] == steps and not meta["training"][-1]["finished"]
    assert main(interrupted) == 0
    a, b = _parts(tmp_path / "whole", recipe), _parts(tmp_path / "parts", recipe)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    meta = json.loads((tmp_path / "parts" / PARTS_JSON[recipe]).read_text())
    run = meta["training"][-1]
    assert run["steps"] == 6 and run["finished"] and run["data"]["kind"] == "file"
    assert 0 <= run["held_out_agreement_after"] <= 1 and "held_out_agreement_subset" in run
    assert (tmp_path / "parts" / "draft_vocab.safetensors").is_file()
    assert not list((tmp_path / "cache" / "checkpoints").iterdir())  # removed once written


def test_resumed_m2r2_run_gives_the_uninterrupted_runs_parts(checkpoint, corpus, tmp_path):
    common = ["train-m2r2", "--model", str(checkpoint), "--data", str(corpus), "--fast-layers",
              "2", "--steps", "5", "--checkpoint-every", "2", "--batch-size", "2", "--seq-len",
              "32", "--cache-dir", str(tmp_path / "cache"), "--quiet"]  # fmt: skip
    assert main([*common, "--out", str(tmp_path / "whole")]) == 0
    interrupted = [*common, "--out", str(tmp_path / "parts")]
    for steps in (1, 2):  # stopped by its clock after every step, the parts so far written
        assert main([*interrupted, "--minutes", "1e-9"]) == 0
        report = json.loads((tmp_path / "parts" / "m2r2_report.json").read_text())
        assert report["steps"] == steps and not report["finished"] and "checkpoint" in report
    assert main(interrupted) == 0
    a, b = (load_file(str(tmp_path / d / "adapter.safetensors")) for d in ("whole", "parts"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    report = json.loads((tmp_path / "parts" / "m2r2_report.json").read_text())
    whole = json.loads((tmp_path / "whole" / "m2r2_report.json").read_text())
    assert report["steps"] == 5 and report["finished"] and "checkpoint" not in report
    assert report["held_out_before"] == whole["held_out_before"]  # kept from the first call
    assert report["held_out_after"] == whole["held_out_after"]
    assert not list((tmp_path / "cache" / "checkpoints").iterdir())  # removed once written


def test_a_checkpoint_of_other_options_is_refused(tmp_path):
    from leapfx import rewrite

    model = tiny_model("llama", layers=3, vocab=64, seed=1)
    tokens = torch.randint(0, 64, (200,), generator=torch.Generator().manual_seed(0))
    sm = rewrite.apply(model, "eagle")
    sm.fit(tokens, steps=2, batch_size=2, seq_len=16, progress=False, checkpoint_dir=tmp_path)
    with pytest.raises(ValueError, match=r"checkpoint_dir: .* was made with other options \(lr"):
        sm.fit(tokens, steps=2, batch_size=2, seq_len=16, lr=5e-3, progress=False,
               checkpoint_dir=tmp_path)  # fmt: skip
