"""The scripts in examples/ still run against the library.

Each script is started in a fresh interpreter: ``quickstart.py`` whole (a tiny random Llama,
seconds), ``offload_memory.py`` on the shipped MoE model with 4 tokens, ``disk_reads.py`` on a
small file (it drives the native reader with the spec the offload runtime uses, so a change of
that spec must change the example too), and every other script with ``--help`` (their imports
and argument parsers; their real runs train or time for minutes). The ``--help`` runs share one
fresh interpreter, each script run as ``__main__`` in turn (an interpreter's start, torch's
import, is most of a ``--help``: ~6 s of CPU here, once instead of once a script).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from leapfx.kernels import cpu_reader

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
SCRIPTS = sorted(p.name for p in EXAMPLES.glob("*.py"))


def _run(*args: str, timeout: float = 300, env: dict[str, str] | None = None) -> str:
    env = None if env is None else {**os.environ, **env}
    done = subprocess.run([sys.executable, *args], capture_output=True, text=True,
                          timeout=timeout, cwd=EXAMPLES.parent, env=env)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_the_examples_are_found():
    assert {"quickstart.py", "disk_reads.py"} <= set(SCRIPTS)


# Runs in a fresh interpreter: each script given as __main__ with --help, as ``python script
# --help`` would (its folder first on sys.path), its exit code and what it printed, as JSON.
HELP = """
import contextlib, io, json, os, runpy, sys
out = {}
for script in sys.argv[1:]:
    sys.argv, printed, code = [script, "--help"], io.StringIO(), 0
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    try:
        with contextlib.redirect_stdout(printed):
            runpy.run_path(script, run_name="__main__")
    except SystemExit as exc:
        code = exc.code or 0
    except BaseException as exc:  # the script's failure, for its own test to report
        code = f"{type(exc).__name__}: {exc}"
    finally:
        sys.path.pop(0)
    out[script] = [code, printed.getvalue()]
print(json.dumps(out))
"""
HELP_SCRIPTS = [s for s in SCRIPTS if s != "quickstart.py"]


@pytest.fixture(scope="module")
def helps() -> dict[str, list]:
    """Each ``--help`` script's exit code and output, from one interpreter."""
    out = _run("-c", HELP, *(f"examples/{s}" for s in HELP_SCRIPTS))
    return json.loads(out.strip().splitlines()[-1])


@pytest.mark.parametrize("script", HELP_SCRIPTS)
def test_example_parses_its_arguments(helps, script):
    code, printed = helps[f"examples/{script}"]
    assert code == 0, code
    assert "usage:" in printed


def test_quickstart_runs_and_is_identical():
    # One intra-op thread, as conftest.py sets for the tests: the script sets none, and on a
    # busy 2-core machine torch's two OpenMP threads wait on each other (69 s of CPU, 8 s here)
    out = _run("examples/quickstart.py", env={"OMP_NUM_THREADS": "1"})
    assert "identical to HF greedy: True" in out


def test_disk_reads_times_every_job_size(tmp_path):
    if not cpu_reader.available():
        pytest.skip("the leapfx_cpu reader extension did not build here")
    out = _run(
        "examples/disk_reads.py", "--experts", "16", "--repeats", "2", "--dir", str(tmp_path)
    )
    rows = [
        r for r in (line.split() for line in out.splitlines()) if len(r) == 3 and r[0].isdigit()
    ]  # experts, us/job, GB/s
    assert [int(r[0]) for r in rows] == [1, 2, 3, 4, 6, 8]
    assert all(float(r[2]) > 0 for r in rows)
    assert list(tmp_path.iterdir()) == []  # its file is removed


def test_offload_memory_on_the_shipped_moe_model():
    out = _run("examples/offload_memory.py", "--tokens", "4")
    rows = {r[0]: r for r in (line.split() for line in out.splitlines()) if len(r) == 6}
    assert set(rows) >= {"resident", "offload", "load_offloaded"}
    assert all(rows[w][5] == "identical" for w in ("offload", "load_offloaded"))
    # model tensors: load_offloaded holds no expert, the others hold all of them
    assert float(rows["load_offloaded"][3]) < float(rows["resident"][3]) / 4
    assert float(rows["offload"][3]) == float(rows["resident"][3])
