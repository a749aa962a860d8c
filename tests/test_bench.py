"""leapfx bench: rows side by side, JSON fields, the speedup formula, one-line errors."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
import transformers

from leapfx import rewrite
from leapfx.bench.harness import SPLIT_MARGIN, BenchConfig, repeated_4gram_share, run_bench
from leapfx.bench.sweep import calibrate, choose, predicted_speedup
from leapfx.cli import main
from leapfx.models import load_model
from leapfx.train.data import byte_tokenizer
from tests.conftest import tiny_model


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("ckpt")
    tok = byte_tokenizer()
    model = tiny_model("llama", layers=4, vocab=len(tok), eos=tok.eos_token_id)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def test_run_bench_rows(checkpoint):
    model, tok = load_model(checkpoint)
    prompts = [torch.tensor([tok("def f(x):\n    return")["input_ids"]])] * 2
    config = BenchConfig(exit_layer=2, num_speculations=3, max_new_tokens=12, repeats=1)
    rows = run_bench(model, prompts, config, progress=False)
    names = [r.system for r in rows]
    assert names == [
        "hf_greedy", "hf_static", "hf_assistant_early_exit", "hf_prompt_lookup",
        "leapfx_autoregressive", "leapfx_early_exit", "leapfx_layerskip",
    ]  # fmt: skip
    by = {r.system: r for r in rows}
    assert by["hf_greedy"].speedup == 1.0
    for name in ("hf_static", "hf_assistant_early_exit", "hf_prompt_lookup",
                 "leapfx_autoregressive", "leapfx_layerskip"):  # fmt: skip
        assert by[name].identical_to_greedy is True
        assert (by[name].identical_prompts, by[name].prompts) == (2, 2)
        assert by[name].differences is None
    ls = by["leapfx_layerskip"]
    static = by["hf_static"]
    assert static.speedup_vs_static == 1.0 and static.extra["hf_compiled"] is False  # CPU
    for r in rows:
        assert r.speedup_vs_static == pytest.approx(r.tokens_per_second / static.tokens_per_second)
    ee = by["leapfx_early_exit"]
    assert 0.0 <= ee.agreement_with_greedy <= 1.0
    assert 0.0 <= ee.agreement <= 1.0 and ee.avg_layers == 2.0  # teacher-forced; E = 2
    assert by["leapfx_autoregressive"].avg_layers == 4.0 and ls.avg_layers is None
    assert ee.agreement >= ee.agreement_with_greedy  # forced never diverges for good
    assert len(ls.ctar) == 3 and ls.mean_accepted_tokens >= 1.0
    assert all(r.tokens_per_second > 0 for r in rows)
    assert 0.0 <= by["hf_greedy"].extra["repeated_4gram_share"] <= 1.0
    x = ls.extra
    assert x["c"] > 0 and x["predicted_vs_autoregressive"] > 0
    assert x["draft_cost"] == x["c"] and x["verify_cost"] > 0
    # Both against one autoregressive decode step: its full-stage time over its steps, the
    # prompts' prefills timed apart (2 prompts, 12 new tokens each: a prefill and 11 steps).
    ar_row = by["leapfx_autoregressive"]
    assert ar_row.extra["full_steps"] == 2 * 11
    assert ar_row.extra["stage_seconds"]["prefill"] > 0
    step_s = ar_row.extra["stage_seconds"]["full"] / ar_row.extra["full_steps"]
    verify_s = x["stage_seconds"]["verify"] / x["verify_calls"]
    assert x["verify_cost"] == pytest.approx(verify_s / step_s)
    ar = by["leapfx_autoregressive"].tokens_per_second
    assert x["measured_vs_autoregressive"] == pytest.approx(ls.tokens_per_second / ar)


def test_speedup_per_pass_pairs_the_systems_of_each_pass(checkpoint, capsys):
    model, tok = load_model(checkpoint)
    prompts = [torch.tensor([tok("def f(x):\n    return")["input_ids"]])]
    config = BenchConfig(exit_layer=2, num_speculations=3, max_new_tokens=12, repeats=3)
    by = {r.system: r for r in run_bench(model, prompts, config, progress=False)}
    ls, ar = by["leapfx_layerskip"], by["leapfx_autoregressive"]
    passes = ls.extra["seconds_per_pass"]
    assert len(passes) == 3 and len(ar.extra["seconds_per_pass"]) == 3
    assert ls.seconds == pytest.approx(sorted(passes)[1])  # the row's time is their median
    want = [
        (ls.new_tokens / s) / (ar.new_tokens / a)
        for s, a in zip(passes, ar.extra["seconds_per_pass"], strict=True)
    ]
    assert ls.extra["measured_vs_autoregressive_per_pass"] == pytest.approx(want)
    code = main([
        "bench", "--recipe", "layerskip", "--model", str(checkpoint), "--prompts", "1",
        "--prompt-tokens", "8",
        "--max-new-tokens", "12", "--repeats", "2", "--warmup", "0", "--exit-layer", "2",
        "--num-speculations", "3", "--quiet", "--cpu-kernels", "off",
    ])  # fmt: skip
    assert code == 0
    out = capsys.readouterr().out
    assert re.search(r"leapfx_layerskip: .* measured .*; per pass \d\.\d\d-\d\.\d\dx", out)
    # The guard against a backend whose stage calls regress: both cost ratios, printed.
    assert re.search(r"leapfx_layerskip: alpha \d\.\d+, c \d\.\d+, verify \d+\.\d\d -> ", out)
    assert "c / verify: the cost of one draft / verify call" in out and "decode step" in out


def test_cli_json_fields(checkpoint, tmp_path, capsys):
    out = tmp_path / "rows.json"
    code = main([
        "bench", "--recipe", "layerskip", "--model", str(checkpoint), "--prompts", "2",
        "--prompt-tokens", "8",
        "--max-new-tokens", "8", "--repeats", "1", "--exit-layer", "2", "--quiet",
        "--json", str(out),
    ])  # fmt: skip
    assert code == 0
    rows = json.loads(out.read_text())
    assert {"system", "tokens_per_second", "speedup", "identical_to_greedy"} <= rows[-1].keys()
    by = {r["system"]: r for r in rows}
    assert by["hf_static"]["identical_to_greedy"] is True
    assert by["hf_static"]["identical_prompts"] == 2 and by["hf_static"]["prompts"] == 2
    assert by["hf_static"]["speedup_vs_static"] == 1.0
    assert all("speedup_vs_static" in r for r in rows)
    assert {"mean_accepted_tokens", "acceptance_rate"} <= rows[-1].keys()
    assert rows[-1]["system"] == "leapfx_layerskip"
    printed = capsys.readouterr().out
    assert "leapfx_layerskip" in printed
    assert re.search(r"hf_static .* 1\.00x .* 2/2", printed)
    assert "vs static" in printed


def _one_line_error(argv, capsys, pattern):
    capsys.readouterr()  # drop what the test's own setup printed
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err
    assert pattern in err, err


def test_bad_model_path(capsys, tmp_path):
    _one_line_error(["bench", "--model", str(tmp_path / "nope")], capsys, "is not a directory")


def test_unsupported_checkpoint(capsys, tmp_path):
    config = transformers.GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=50)
    transformers.GPT2LMHeadModel(config).save_pretrained(tmp_path)
    _one_line_error(["bench", "--model", str(tmp_path)], capsys, "'gpt2'")


def test_exit_layer_beyond_depth(checkpoint, capsys):
    argv = ["bench", "--model", str(checkpoint), "--exit-layer", "9"]
    _one_line_error(argv, capsys, "--exit-layer: 9 is out of range")


def test_predicted_speedup_formula():
    assert predicted_speedup(0.0, 4, 0.1) == pytest.approx(1 / 1.4)
    assert predicted_speedup(1.0, 4, 0.0) == pytest.approx(5.0)
    alpha, d, c = 0.8, 5, 0.25
    assert predicted_speedup(alpha, d, c) == pytest.approx((1 - 0.8**6) / (0.2 * 2.25))


def test_calibrate_and_choose(checkpoint):
    model, tok = load_model(checkpoint)
    prompts = [torch.tensor([tok("import os\n")["input_ids"]])]
    cal = calibrate(model, prompts, [1, 2], [2, 3], max_new_tokens=8, progress=False)
    assert [(c.exit_layer, c.num_speculations) for c in cal] == [(1, 2), (1, 3), (2, 2), (2, 3)]
    assert all(0.0 <= c.alpha <= 1.0 and c.c > 0 for c in cal)
    assert choose(cal).measured == max(c.measured for c in cal)


def test_auto_says_whether_its_choice_beats_autoregressive_decoding():
    from dataclasses import replace

    from leapfx.bench.sweep import Calibration, pays

    # SmolLM2's best LayerSkip setting: an exit after 15 of 30 layers agrees 8% of the time
    slow = Calibration(15, 1, alpha=0.08, acceptance_rate=0.08, c=0.55, tokens_per_second=20.0,
                       predicted=0.69, measured=0.73)  # fmt: skip
    assert not pays(slow)
    assert pays(replace(slow, measured=1.2))
    assert not pays(replace(slow, measured=1.0))  # a tie does not pay for the drafts
    assert pays(replace(slow, measured=None, predicted=1.1))  # unmeasured: the prediction


def test_repeated_4gram_share():
    assert repeated_4gram_share([1, 2, 3, 4, 5, 6]) == 0.0
    assert repeated_4gram_share([1, 2, 3, 4, 1, 2, 3, 4]) == pytest.approx(1 / 5)
    assert repeated_4gram_share([7] * 10) == pytest.approx(6 / 7)


def test_kangaroo_rows(checkpoint):
    model, tok = load_model(checkpoint)
    prompts = [torch.tensor([tok("class A:\n    def")["input_ids"]])]
    config = BenchConfig(recipe="kangaroo", exit_layer=2, num_speculations=3, max_new_tokens=10,
                         repeats=1, kangaroo_exit_layer=1)  # fmt: skip
    rows = run_bench(model, prompts, config, progress=False)
    by = {r.system: r for r in rows}
    assert list(by)[-3:] == ["leapfx_layerskip", "leapfx_kangaroo_fixed", "leapfx_kangaroo"]
    assert all(by[n].identical_to_greedy for n in list(by)[-3:])
    assert len(by["leapfx_kangaroo"].ctar) == 3


def test_recipe_takes_a_comma_list_and_lookup_has_a_row(checkpoint):
    model, tok = load_model(checkpoint)
    prompts = [torch.tensor([tok("x = 1\ny = 2\nx = 1\ny")["input_ids"]])]
    config = BenchConfig(recipe="lookup,layerskip,kangaroo,auto,swift", exit_layer=2,
                         num_speculations=3, max_new_tokens=10, repeats=1,
                         kangaroo_exit_layer=1)  # fmt: skip
    rows = run_bench(model, prompts, config, progress=False)
    names = [r.system for r in rows]
    assert names.count("leapfx_layerskip") == 1  # both layerskip and kangaroo runs carry it
    assert {"leapfx_lookup", "leapfx_kangaroo", "leapfx_auto", "leapfx_swift"} <= set(names)
    lookup = rows[names.index("leapfx_lookup")]
    assert lookup.identical_to_greedy and lookup.extra["dynamic_draft_length"] is True
    assert set(lookup.extra["drafter_rounds"]) <= {"lookup", "none"}
    assert rows[names.index("leapfx_auto")].identical_to_greedy
    adaptive = rows[names.index("leapfx_swift_adaptive")]  # swift + lookup, chosen per round
    assert adaptive.identical_to_greedy and adaptive.extra["dynamic_draft_length"] is True
    assert set(adaptive.extra["drafter_rounds"]) <= {"lookup", "swift", "declined", "none"}
    for bad, message in [("lookup,nope", "'nope' is not benchmarked"),
                         ("lookup,lookup", "comma-separated without repeats")]:  # fmt: skip
        with pytest.raises(ValueError, match=message):
            run_bench(model, prompts, BenchConfig(recipe=bad, max_new_tokens=2), progress=False)


def test_layerskip_dynamic_row(checkpoint, capsys):
    # eta > 0 on a layerskip run adds a dynamic-length row: lossless, no formula (the formula
    # assumes d drafts a round), its measured ratio printed on its own line.
    model, tok = load_model(checkpoint)
    prompts = [torch.tensor([tok("def f(x):\n    return")["input_ids"]])]
    config = BenchConfig(exit_layer=2, num_speculations=4, max_new_tokens=16, repeats=1,
                         confidence_threshold=0.9)  # fmt: skip
    by = {r.system: r for r in run_bench(model, prompts, config, progress=False)}
    assert list(by)[-2:] == ["leapfx_layerskip", "leapfx_layerskip_dynamic"]
    dyn, fixed = by["leapfx_layerskip_dynamic"], by["leapfx_layerskip"]
    assert dyn.identical_to_greedy is True
    assert "predicted_vs_autoregressive" not in dyn.extra
    assert "predicted_vs_autoregressive" in fixed.extra
    assert dyn.extra["draft_calls"] < 4 * dyn.extra["verify_calls"]  # rounds stopped early
    ar = by["leapfx_autoregressive"].tokens_per_second
    assert dyn.extra["measured_vs_autoregressive"] == pytest.approx(dyn.tokens_per_second / ar)
    code = main([
        "bench", "--recipe", "layerskip", "--model", str(checkpoint), "--prompts", "1",
        "--prompt-tokens", "8",
        "--max-new-tokens", "12", "--repeats", "1", "--warmup", "0", "--exit-layer", "2",
        "--num-speculations", "3", "--quiet", "--cpu-kernels", "off",
        "--confidence-threshold", "0.9",
    ])  # fmt: skip
    assert code == 0
    out = capsys.readouterr().out
    assert re.search(r"leapfx_layerskip_dynamic: alpha .*dynamic draft length .*measured", out)


def test_onnxruntime_backend_rows(checkpoint, tmp_path):
    model, tok = load_model(checkpoint)
    prompts = [torch.tensor([tok("for i in range(")["input_ids"]])]
    config = BenchConfig(recipe="autoregressive", exit_layer=2, max_new_tokens=8, repeats=1,
                         warmup=0, backend="onnxruntime", export_dir=str(tmp_path))  # fmt: skip
    rows = run_bench(model, prompts, config, progress=False)
    by = {r.system: r for r in rows}
    assert by["leapfx_autoregressive"].identical_to_greedy is True
    assert (tmp_path / "leapfx_autoregressive" / "manifest.json").is_file()
    # auto: the faster of 1 and torch's thread count, timed on the autoregressive export
    x = by["leapfx_autoregressive"].extra
    counts = sorted({1, torch.get_num_threads()})
    assert x["onnx_threads"] in counts
    if len(counts) > 1:
        timing = x["onnx_threads_timing"]
        assert sorted(timing) == counts and x["onnx_threads"] == min(timing, key=timing.get)


def test_m2r2_rows_on_onnxruntime_skip_m2r2_exit_with_its_refusal(caplog):
    # m2r2 exports (its row stays); m2r2_exit's per-layer exits do not: no row, a warning
    # quoting the refusal. The rows are built, not run (``ours`` records them).
    from leapfx.bench.systems import RowRun, _m2r2_rows

    model = tiny_model("llama", layers=4)
    built = []

    def ours(name, sm, lossless=True):
        built.append(name)
        return name

    both = ["leapfx_kangaroo", "leapfx_m2r2"]
    for backend, rows in (("onnxruntime", both), ("eager", [*both, "leapfx_m2r2_exit"])):
        built.clear()
        _m2r2_rows(RowRun(model, BenchConfig(recipe="m2r2"), ours, {}, backend))
        assert built == rows, backend
    assert "no leapfx_m2r2_exit row on onnxruntime: its stages run eager only" in caplog.text


@pytest.mark.slow  # five exports
def test_onnxruntime_eagle_rows(tmp_path):
    # `leapfx bench --backend onnxruntime --recipe eagle`: EAGLE's head and target stages
    # exported, its rows lossless on onnxruntime.
    pytest.importorskip("onnxruntime")
    tok = byte_tokenizer()
    model = tiny_model("llama", layers=2, head_dim=16, vocab=len(tok), eos=tok.eos_token_id)
    rewrite.apply(model, "eagle", parts=None, max_draft_tokens=3).save_parts(tmp_path / "head")
    prompts = [torch.tensor([tok("for i in range(")["input_ids"]])]
    config = BenchConfig(recipe="eagle", max_new_tokens=8, repeats=1, warmup=0,
                         backend="onnxruntime", export_dir=str(tmp_path / "onnx"),
                         hf_baselines=False, onnx_threads=1,
                         eagle_parts=str(tmp_path / "head"))  # fmt: skip
    rows = {r.system: r for r in run_bench(model, prompts, config, progress=False)}
    assert (tmp_path / "onnx" / "leapfx_eagle" / "head.onnx").is_file()
    for name in ("leapfx_eagle", "leapfx_eagle_lookup"):
        assert rows[name].identical_to_greedy is True, name
    assert rows["leapfx_eagle"].extra["onnx_threads"] == 1


def test_auto_on_onnxruntime_runs_its_exportable_form_where_a_head_is_found(tmp_path):
    # The reference model ships an EAGLE head, which apply(model, "auto") runs: the
    # onnxruntime row runs auto in its lookup form, adaptive lookup, as `leapfx export` does
    # (the form leapfx.deploy runs; the head exports as the eagle recipe's rows).
    model, tok = load_model(None, progress=False)
    prompts = [torch.tensor([tok("for i in range(10):")["input_ids"]])]
    config = BenchConfig(recipe="auto", max_new_tokens=4, repeats=1, warmup=0,
                         backend="onnxruntime", export_dir=str(tmp_path),
                         hf_baselines=False, onnx_threads=1)  # fmt: skip
    rows = {r.system: r for r in run_bench(model, prompts, config, progress=False)}
    assert rows["leapfx_auto"].extra["auto_as"] == "auto"
    assert rows["leapfx_auto"].identical_to_greedy is True


def test_fixed_onnx_threads_and_their_errors(checkpoint, tmp_path, monkeypatch):
    from leapfx.bench import harness

    model, tok = load_model(checkpoint)
    prompts = [torch.tensor([tok("for i in range(")["input_ids"]])]
    monkeypatch.setattr(harness, "fastest_onnx_threads", None)  # a fixed count times nothing
    config = BenchConfig(recipe="autoregressive", max_new_tokens=4, repeats=1, warmup=0,
                         backend="onnxruntime", export_dir=str(tmp_path), onnx_threads=1,
                         hf_baselines=False, throughput_only=True)  # fmt: skip
    (row,) = run_bench(model, prompts, config, progress=False)
    assert row.extra["onnx_threads"] == 1 and row.extra["onnx_threads_timing"] is None
    with pytest.raises(ValueError, match="--onnx-threads: 0 is invalid; allowed: auto or an"):
        BenchConfig(onnx_threads=0).validate()
    assert main(["bench", "--onnx-threads", "two"]) == 2


def test_onnx_verify_threads_errors():
    # --onnx-verify-threads: same (the rows' count), auto (timed per export) or a count.
    from leapfx.cli import _onnx_verify_threads

    assert [_onnx_verify_threads(v) for v in ("same", "auto", "2")] == [None, "auto", 2]
    BenchConfig(onnx_verify_threads="auto").validate()
    with pytest.raises(ValueError, match="--onnx-verify-threads: 0 is invalid; allowed: same"):
        BenchConfig(onnx_verify_threads=0).validate()
    assert main(["bench", "--onnx-verify-threads", "two"]) == 2


def _head_dim_16_model():
    """A 4-layer Llama of head size 16 over the byte tokenizer, and the tokenizer."""
    tok = byte_tokenizer()
    return tiny_model("llama", layers=4, head_dim=16, vocab=len(tok), eos=tok.eos_token_id), tok


def test_onnx_split_verify_timed_or_fixed(tmp_path, monkeypatch):
    # auto: split and whole verify timed on each layerskip export, the faster runs the row;
    # on / off: as asked, timing nothing. Either way the rows stay identical to greedy.
    # (head_dim 16: the export's attention fuses, which the split needs)
    model, tok = _head_dim_16_model()
    prompts = [torch.tensor([tok("for i in range(")["input_ids"]])]
    base = dict(exit_layer=2, num_speculations=3, max_new_tokens=8, repeats=1, warmup=0,
                backend="onnxruntime", onnx_threads=1, hf_baselines=False)  # fmt: skip
    # The rows' exports depend on the model and options only: the modes after the first copy
    # the first's instead of exporting again (an export is most of this test's time).
    from leapfx.runtime.model import SpeculativeModel

    export_onnx = SpeculativeModel.export_onnx
    made: dict[str, Path] = {}

    def export_once(sm, path, **kw):
        name = Path(path).name
        if name not in made:
            made[name] = Path(export_onnx(sm, path, **kw))
            return made[name]
        shutil.copytree(made[name], path, dirs_exist_ok=kw.get("overwrite", False))
        return path

    monkeypatch.setattr(SpeculativeModel, "export_onnx", export_once)
    for mode in ("auto", "on", "off"):
        config = BenchConfig(**base, export_dir=str(tmp_path / mode), onnx_split_verify=mode)
        by = {r.system: r for r in run_bench(model, prompts, config, progress=False)}
        x = by["leapfx_layerskip"].extra
        assert by["leapfx_layerskip"].identical_to_greedy is True
        timing = x["onnx_split_verify_timing"]
        if mode == "auto":
            assert sorted(timing) == ["split", "whole"]
            # split only where it times faster by more than SPLIT_MARGIN (two calls a verify)
            assert x["onnx_split_verify"] == (
                timing["split"] < timing["whole"] * (1 - SPLIT_MARGIN)
            )
        else:
            assert timing is None and x["onnx_split_verify"] == (mode == "on")
        assert "onnx_split_verify" not in by["leapfx_autoregressive"].extra  # nothing to split
    with pytest.raises(ValueError, match="--onnx-split-verify: 'yes' is invalid; allowed: auto"):
        BenchConfig(onnx_split_verify="yes").validate()
    with pytest.raises(SystemExit) as exit_:  # argparse: invalid choice, usage, status 2
        main(["bench", "--onnx-split-verify", "yes"])
    assert exit_.value.code == 2


def test_onnx_thread_pool_option():
    # `leapfx bench` puts its onnxruntime rows on one process-wide pool by default (its process
    # decodes with leapfx only); run_bench, a library call, keeps a pool per session.
    from leapfx.cli import build_parser

    assert build_parser().parse_args(["bench"]).onnx_thread_pool == "shared"
    assert BenchConfig().onnx_thread_pool == "session"
    with pytest.raises(ValueError, match="--onnx-thread-pool: 'x' is invalid; allowed: shared"):
        BenchConfig(onnx_thread_pool="x").validate()
    with pytest.raises(ValueError, match="--onnx-verify-threads: 'auto' gives verify's upper"):
        BenchConfig(onnx_thread_pool="shared", onnx_verify_threads="auto").validate()


def test_cost_ratios_per_backend(tmp_path):
    # Every backend's speculative row carries its own draft and verify cost ratios, measured
    # against the autoregressive row of the same backend. (The split-verify test's model and
    # options: the same stages, which the suite's ONNX memo then exports once for both.)
    model, tok = _head_dim_16_model()
    prompts = [torch.tensor([tok("for i in range(")["input_ids"]])]
    config = BenchConfig(exit_layer=2, num_speculations=3, max_new_tokens=10, repeats=1,
                         warmup=0, backend="eager,onnxruntime",
                         export_dir=str(tmp_path))  # fmt: skip
    by = {r.system: r for r in run_bench(model, prompts, config, progress=False)}
    for backend in ("eager", "onnxruntime"):
        x = by[f"leapfx_layerskip@{backend}"].extra
        ar = by[f"leapfx_autoregressive@{backend}"]
        draft_s = x["stage_seconds"]["draft"] / x["draft_calls"]
        step_s = ar.extra["stage_seconds"]["full"] / ar.extra["full_steps"]
        assert x["draft_cost"] == pytest.approx(draft_s / step_s)
        assert x["verify_cost"] > 0
        assert by[f"leapfx_layerskip@{backend}"].identical_to_greedy is True


def test_unknown_backend():
    with pytest.raises(ValueError, match="--backend: 'tvm' is invalid"):
        BenchConfig(backend="tvm").validate()


def test_reference_bench_defaults_to_its_measured_setting(tmp_path, capsys):
    # Without --exit-layer / --num-speculations, layerskip on the shipped model runs E=6, d=4
    # (the sweep's best there); an explicit flag wins.
    out = tmp_path / "rows.json"
    argv = ["bench", "--recipe", "layerskip", "--prompts", "1", "--prompt-tokens", "8",
            "--max-new-tokens", "6", "--repeats", "1", "--warmup", "0", "--quiet",
            "--cpu-kernels", "off", "--json", str(out)]  # fmt: skip
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "reference model: exit_layer=6 num_speculations=4" in printed
    assert "leapfx_layerskip_dynamic at eta 0.5" in printed
    rows = json.loads(out.read_text())
    run = rows[-1]["run"]
    assert (run["exit_layer"], run["num_speculations"]) == (6, 4)
    assert run["confidence_threshold"] == 0.5
    assert [r["system"] for r in rows[-2:]] == ["leapfx_layerskip", "leapfx_layerskip_dynamic"]
    assert main([*argv, "--num-speculations", "2"]) == 0
    assert json.loads(out.read_text())[-1]["run"]["num_speculations"] == 2


def test_differing_prompts_are_located_and_explained(checkpoint, monkeypatch):
    # A "lossless" system that changes one token of the second prompt: the row says 1/2, and the
    # JSON says where (new token 3) and that the gap there is no float tie.
    from leapfx.bench import harness
    from leapfx.bench.report import table

    model, tok = load_model(checkpoint)
    prompts = [torch.tensor([tok(t)["input_ids"]]) for t in ("import os\n", "def g(y):\n")]

    def hf(prompt):
        return model.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False,
                              max_new_tokens=6)  # fmt: skip

    def broken(prompt):
        out = hf(prompt).clone()
        if prompt is prompts[1]:
            t = prompt.shape[1] + 3
            logits = model(out[:, :t]).logits[0, -1]
            out[0, t] = int(logits.argsort()[0])  # the least likely token: far from a tie
        return out

    systems = [harness.System("hf_greedy", hf), harness.System("leapfx_broken", broken)]
    monkeypatch.setattr(harness, "build_systems", lambda model, config: systems)
    config = BenchConfig(max_new_tokens=6, repeats=1, warmup=0)
    rows = run_bench(model, prompts, config, progress=False)
    row = rows[1]
    assert row.identical_to_greedy is False
    assert (row.identical_prompts, row.prompts) == (1, 2)
    [diff] = row.differences
    assert diff["prompt"] == 1 and diff["new_token"] == 3
    assert diff["near_tie"] is False and diff["logit_gap"] > diff["tolerance"]
    assert "1/2 (1 NOT a tie)" in table(rows)


def test_random_model_sizes_are_documented_shapes():
    # Counted on the meta device: a 0.5B model is never built in CI.
    from leapfx.bench.random_model import parameter_count, random_config

    c = random_config("0.5b")
    assert (c.num_hidden_layers, c.hidden_size, c.num_attention_heads,
            c.num_key_value_heads, c.head_dim) == (16, 1536, 12, 4, 128)  # fmt: skip
    assert c.eos_token_id is None  # every run generates max_new_tokens
    assert parameter_count("0.5b") == 501_007_872
    assert parameter_count("1b") == 1_104_218_112
    with pytest.raises(ValueError, match="--random-model: '7b' is invalid; allowed: tiny, 0.5b"):
        random_config("7b")


def test_random_model_is_seeded_and_takes_a_dtype():
    from leapfx.bench.random_model import random_model

    a, tok = random_model("tiny", dtype="bfloat16")
    b, _ = random_model("tiny", dtype=torch.bfloat16)
    assert next(a.parameters()).dtype == torch.bfloat16
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters(), strict=True))
    assert max(tok("def f(x):")["input_ids"]) < a.config.vocab_size
    with pytest.raises(ValueError, match="--dtype: 'fp8' is invalid; allowed: float32, bfloat16"):
        random_model("tiny", dtype="fp8")


def test_cli_random_model_runs_throughput_rows_only(tmp_path, capsys):
    out = tmp_path / "rows.json"
    code = main([
        "bench", "--random-model", "tiny", "--dtype", "bfloat16", "--prompts", "2",
        "--prompt-tokens", "8", "--max-new-tokens", "8", "--repeats", "1", "--warmup", "0",
        "--quiet", "--json", str(out),
    ])  # fmt: skip
    assert code == 0
    printed = capsys.readouterr().out
    assert "random model tiny: Llama-shaped, random weights" in printed
    assert "Throughput only" in printed
    rows = json.loads(out.read_text())
    assert [r["system"] for r in rows] == ["hf_greedy", "hf_static", "leapfx_autoregressive"]
    run = rows[0]["run"]
    assert (run["model"], run["dtype"], run["throughput_only"]) == ("random:tiny", "bfloat16", True)
    for r in rows[1:]:  # bf16: equal, or every difference located and judged
        assert r["identical_prompts"] + len(r.get("differences", [])) == 2


def test_random_model_refuses_what_needs_acceptance(capsys):
    argv = ["bench", "--random-model", "tiny", "--sweep"]
    _one_line_error(argv, capsys, "--sweep: not with --random-model tiny")
    argv = ["bench", "--random-model", "tiny", "--model", "x"]
    _one_line_error(argv, capsys, "--model: not with --random-model tiny")


def test_load_model_dtype(checkpoint):
    model, _ = load_model(checkpoint, dtype="float16")
    assert next(model.parameters()).dtype == torch.float16
    assert next(load_model(checkpoint)[0].parameters()).dtype == torch.float32  # CPU default


def test_run_bench_interleaves_the_systems_prompt_by_prompt(monkeypatch):
    # Every prompt is decoded by every system in turn (order rotated each time), so a busy
    # spell of the machine falls on all rows alike; each row still gets its own outputs in
    # prompt order and one time per pass (the sum of its decodes).
    from leapfx.bench import harness

    calls = []

    def system(name: str):
        def generate(prompt):
            calls.append((name, int(prompt[0, 0])))
            return torch.cat([prompt, prompt[:, :1]], dim=1)

        return harness.System(name, generate)

    systems = [system("a"), system("b"), system("c")]
    monkeypatch.setattr(harness, "build_systems", lambda model, config: systems)
    monkeypatch.setattr(
        harness, "_rows", lambda systems, prompts, config, times, first: (times, first)
    )
    monkeypatch.setattr(harness, "_explain_differences", lambda *a: None)
    prompts = [torch.tensor([[i, 7]]) for i in (10, 11)]
    times, first = run_bench(None, prompts, BenchConfig(repeats=2, warmup=1), progress=False)
    # pass-major, then prompt-major; the order rotates by one each (pass, prompt)
    assert calls[:6] == [("a", 10), ("b", 10), ("c", 10), ("b", 11), ("c", 11), ("a", 11)]
    assert calls[6:9] == [("c", 10), ("a", 10), ("b", 10)]
    assert len(calls) == 3 * 2 * 3
    assert all(len(t) == 2 for t in times.values())  # the two timed passes, not the warm-up
    for name in "abc":
        assert [o[0, 0].item() for o in first[name].outputs] == [10, 11]
