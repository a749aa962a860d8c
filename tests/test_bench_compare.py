"""``leapfx bench --compare OLD.json``: ratios over the same backend's autoregressive row that
fell by more than their pass-to-pass spread, and nothing else."""

from __future__ import annotations

import json

from leapfx.bench.compare import MIN_SPREAD, drops, ratios, report
from leapfx.cli import main


def _row(system, tps, passes=None, new_tokens=100):
    extra = {} if passes is None else {"seconds_per_pass": [new_tokens / p for p in passes]}
    return {"system": system, "tokens_per_second": tps, "new_tokens": new_tokens, "extra": extra}


def test_a_ratio_falls_only_beyond_its_spread_and_per_backend():
    old = [
        _row("leapfx_autoregressive", 10.0, [10.0, 10.0]),
        _row("leapfx_layerskip", 15.0, [14.0, 16.0]),  # per pass 1.4 - 1.6: spread 0.1
        _row("leapfx_autoregressive@onnxruntime", 8.0),
        _row("leapfx_layerskip@onnxruntime", 12.5),  # 1.56x its own backend's row
        _row("hf_greedy", 5.0),
    ]
    new = [
        _row("leapfx_autoregressive", 20.0, [20.0, 20.0]),
        _row("leapfx_layerskip", 28.5, [28.0, 29.0]),  # 1.425: within 0.1 of 1.5
        _row("leapfx_autoregressive@onnxruntime", 16.0),
        _row("leapfx_layerskip@onnxruntime", 20.3),  # 1.27x: fell by 0.29
        _row("hf_greedy", 2.0),  # 0.1x: fell, HF rows too are ratios over autoregressive
    ]
    assert abs(ratios(old)["leapfx_layerskip"].spread - 0.1) < 1e-9
    assert ratios(old)["leapfx_layerskip@onnxruntime"].spread == MIN_SPREAD * 12.5 / 8.0
    assert "leapfx_autoregressive" not in ratios(old)
    found = {d.system: d for d in drops(new, old)}
    assert sorted(found) == ["hf_greedy", "leapfx_layerskip@onnxruntime"]
    assert round(found["leapfx_layerskip@onnxruntime"].old, 2) == 1.56
    assert drops(old, old) == []


def test_the_report_and_the_cli_refusal(tmp_path, capsys):
    path = tmp_path / "old.json"
    old = [_row("leapfx_autoregressive", 10.0), _row("leapfx_lookup", 15.0)]
    path.write_text(json.dumps(old))
    text = report([_row("leapfx_autoregressive", 10.0), _row("leapfx_lookup", 12.0)], path)
    assert "1 fell by more than their spread" in text and "leapfx_lookup: 1.50x -> 1.20x" in text
    assert "none fell" in report(old, path)
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    assert main(["bench", "--compare", str(bad)]) == 2  # before any model loads
    err = capsys.readouterr().err
    assert "--compare" in err and "holds no bench rows" in err


def test_compare_alone_reads_the_run_recorded_for_the_model_and_prompts(tmp_path, capsys):
    from leapfx.bench.compare import RECORDED, recorded

    # the runs the docs quote are recorded, and hold bench rows of the model and prompts named
    for model, prompts in ((None, "stdlib"), ("smollm2", "humaneval"), ("smollm2", "chat")):
        rows = json.loads(recorded(model, prompts).read_text())
        assert any(r["system"].startswith("leapfx_autoregressive") for r in rows)
        run = next(r["run"] for r in rows if "run" in r)
        assert (run["model"], run["prompt_set"]) == (model or "reference", prompts)
    assert recorded(None, "stdlib").parent == RECORDED
    try:
        recorded("smollm2", "stdlib", folder=tmp_path)
    except ValueError as e:
        assert "--compare" in str(e) and "smollm2-stdlib.json is missing" in str(e)
    else:
        raise AssertionError("a missing recorded run was not refused")
    # the CLI: --compare alone, for a model and prompts with no recorded run, refused up front
    assert main(["bench", "--model", "smollm2", "--prompt-set", "stdlib", "--compare"]) == 2
    err = capsys.readouterr().err
    assert "no run is recorded for --model smollm2 --prompt-set stdlib" in err


def test_the_report_names_the_settings_two_runs_differ_in(tmp_path):
    path = tmp_path / "old.json"
    run = {"model": "smollm2", "prompt_set": "chat", "weights": "native"}
    old = [{**_row("leapfx_autoregressive", 10.0), "run": run}]
    path.write_text(json.dumps(old))
    new = [{**_row("leapfx_autoregressive", 10.0), "run": {**run, "prompt_set": "humaneval"}}]
    assert "differ in prompt_set 'chat' then, 'humaneval' now" in report(new, path)
    assert "differ" not in report(old, path)
    # a three-backend run's eager rows are a one-backend eager run's rows
    three = [_row("leapfx_autoregressive@eager", 10.0), _row("leapfx_lookup@eager", 15.0)]
    path.write_text(json.dumps(three))
    text = report([_row("leapfx_autoregressive", 10.0), _row("leapfx_lookup", 12.0)], path)
    assert "1 ratios over leapfx_autoregressive in both" in text and "1.50x -> 1.20x" in text
