"""The command line: demo runs end to end; bad input is one line, not a traceback."""

from __future__ import annotations

import json

from leapfx.cli import main


def test_demo_json_reports_identity(capsys):
    assert main(["demo", "--json", "--max-new-tokens", "24"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["identical_to_hf_greedy"] is True
    assert result["new_tokens"] == 24
    assert result["verify_calls"] > 0


def test_demo_bad_exit_layer_is_one_line(capsys):
    assert main(["demo", "--exit-layer", "99"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "exit_layer: 99 is invalid" in err
