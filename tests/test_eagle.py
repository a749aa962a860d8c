"""The EAGLE head: the pass, its stages and KV slot, training, parts on disk, errors."""

from __future__ import annotations

import json

import pytest
import torch

from leapfx import rewrite
from leapfx.modules.eagle import EagleHead
from leapfx.passes.capture import EXTRA_CACHE_LAYERS, capture, nodes_by_role
from leapfx.passes.eagle_head import (
    InsertEagleHead,
    eagle_head_of,
    eagle_layer_of,
    eagle_stages,
)
from leapfx.runtime.eagle import head_step, target_step
from leapfx.runtime.masks import masks_for
from leapfx.runtime.runner import StageRunner
from leapfx.train.eagle import eagle_losses, head_outputs, teacher_features
from tests.conftest import ARCHS, tiny_model
from tests.greedy_check import hf_greedy
from tests.test_partition import _check_golden


def test_pass_inserts_a_head_the_graph_owns():
    model = tiny_model("llama", layers=4)
    before = dict(model.state_dict())
    result = InsertEagleHead().run(capture(model))
    gm = result.graph_module
    assert result.matches == 1 and result.modified
    gm.graph.lint()
    head = eagle_head_of(gm)
    assert isinstance(head, EagleHead) and head.init_layer == 3
    assert eagle_layer_of(gm) == 4 and head.cache_layer == 4 and gm.meta[EXTRA_CACHE_LAYERS] == 1
    # A copy of the last layer, not a reference; the user's model gains nothing.
    assert torch.equal(head.layer.mlp.up_proj.weight, model.model.layers[3].mlp.up_proj.weight)
    assert (
        head.layer.mlp.up_proj.weight.data_ptr()
        != model.model.layers[3].mlp.up_proj.weight.data_ptr()
    )
    assert dict(model.state_dict()).keys() == before.keys()
    assert model.model.layers[3].self_attn.layer_idx == 3
    roles = [n.meta.get("leapfx.role") for n in gm.graph.nodes]
    assert roles.count("eagle_layer") == 1 and roles.count("eagle_head") == 1
    # Running the pass again matches nothing.
    again = InsertEagleHead().run(gm)
    assert again.matches == 0 and not again.modified


def test_whole_graph_computes_the_host_and_the_teacher_forced_head():
    model = tiny_model("qwen3", layers=3)
    gm = InsertEagleHead().run(capture(model)).graph_module
    gm.recompile()  # as the pass pipeline does after every pass
    ids = torch.randint(0, 128, (1, 9))
    pos = torch.arange(9)[None]
    masks = masks_for("sdpa", ["full_attention"], 0, 9, window=None, dtype=torch.float32,
                      device="cpu")  # fmt: skip
    with torch.no_grad():
        out = gm(ids, pos, masks, None)
        ref = model(ids).logits
    torch.testing.assert_close(out["logits"], ref)
    sm = rewrite.apply(model, "eagle")
    with torch.no_grad():
        h, logits = teacher_features(sm, ids)
        g, head_logits = head_outputs(sm, ids, h)
    torch.testing.assert_close(out["last_hidden"], h)
    torch.testing.assert_close(logits, ref)
    torch.testing.assert_close(out["eagle_logits"], head_logits, rtol=1e-5, atol=1e-5)


def test_pass_out_of_range_and_after_layers_are_replaced():
    model = tiny_model("llama", layers=4)
    for bad in (-1, 4, True):
        with pytest.raises(ValueError, match=r"init_layer: .* allowed: 0\.\.3"):
            InsertEagleHead(init_layer=bad).run(capture(model))
    with pytest.raises(ValueError, match="init_layer: 9 is invalid; allowed: an integer 0..3"):
        rewrite.apply(model, "eagle", init_layer=9)


def test_golden_eagle_stage_text():
    sm = rewrite.apply(tiny_model("llama", layers=4), "eagle")
    assert sorted(sm.stages.modules) == ["head", "target"]
    _check_golden("eagle_llama4", sm.stages.code())


@pytest.mark.parametrize("arch", ARCHS)
def test_stages_and_head_slot_agree_with_the_whole_graph(arch):
    """Prefill through ``target`` then one ``head`` step reads exactly the head's KV of the
    teacher-forced whole graph; cropping the head's slot and verifying matches the host."""
    window = 4 if arch in ("mistral", "qwen2", "phi3") else None
    model = tiny_model(arch, layers=3, sliding_window=window)
    sm = rewrite.apply(model, "eagle")
    ids = torch.randint(0, 128, (1, 10), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        h, logits = teacher_features(sm, ids)
        _, head_logits = head_outputs(sm, ids, h)
    with torch.inference_mode():  # as generate() runs (the cache holds inference tensors)
        cache = sm._cache_for(16)
        runner = StageRunner(sm.stages.modules, cache, sm._layout)
        m = 6
        t_logits, t_hidden = target_step(runner, ids[:, :m], None, 0)
        # a prompt (position 0): the head on its last position only (executor.prefill_stage)
        torch.testing.assert_close(t_logits, logits[:, m - 1 : m], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(t_hidden, h[:, :m], rtol=1e-5, atol=1e-5)
        assert cache.lengths == [m] * 4
        d_logits, g = head_step(runner, ids[:, m : m + 2], t_hidden[:, -1:].repeat(1, 2, 1), m)
        torch.testing.assert_close(d_logits[:, :1], head_logits[:, m : m + 1], rtol=1e-5,
                                   atol=1e-5)  # fmt: skip
        assert cache.lengths == [m, m, m, m + 2]
        cache.crop(m)  # the schedule's drop of the draft's head KV
        v_logits, v_hidden = target_step(runner, ids[:, m:], t_hidden[:, -1:], m)
        torch.testing.assert_close(v_logits, logits[:, m:], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(v_hidden, h[:, m:], rtol=1e-5, atol=1e-5)
        assert cache.lengths == [10] * 4
        # The head's KV now holds the teacher-forced states: a step at the end agrees too.
        cache.crop(9)
        target_step(runner, ids[:, 9:], h[:, 8:9], 9)
        cache.crop(9)
        last, _ = head_step(runner, ids[:, 9:], h[:, 8:9], 9)
        torch.testing.assert_close(last, head_logits[:, 9:], rtol=1e-5, atol=1e-5)


def test_generate_is_hf_greedy_and_counts_rounds():
    model = tiny_model("llama", layers=4, seed=4)
    prompt = torch.tensor([[3, 14, 15, 92, 65]])
    sm = rewrite.apply(model, "eagle", max_draft_tokens=3, confidence_threshold=0.0)
    out = sm.generate(prompt, max_new_tokens=20)
    assert torch.equal(out, hf_greedy(model, prompt, 20))
    m = sm.last_metrics
    assert m.schedule == "eagle" and m.num_speculations == 3
    assert m.draft_calls == m.drafted_tokens and m.verify_calls > 0
    assert all(1 <= s <= 4 for s in m.accepted_per_verify)
    emitted = 1  # the prefill's token
    for d, s in zip(m.drafted_per_verify, m.accepted_per_verify, strict=True):
        assert d == min(3, 20 - emitted - 1)  # threshold 0: fixed length unless truncated
        emitted += s


def test_fit_trains_only_the_head_and_raises_agreement_on_its_data():
    model = tiny_model("llama", layers=3, vocab=64, seed=2)
    prompt = torch.tensor([[1, 2, 3]])
    text = hf_greedy(model, prompt, 150)[0]  # the model's own continuation: learnable
    sm = rewrite.apply(model, "eagle")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    head_before = {k: v.clone() for k, v in eagle_head_of(sm.graph_module).state_dict().items()}
    result = sm.fit(text, steps=40, batch_size=4, seq_len=48, lr=3e-3, eval_data=text,
                    progress=False)  # fmt: skip
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    after = eagle_head_of(sm.graph_module).state_dict()
    assert any(not torch.equal(head_before[k], after[k]) for k in after)
    assert len(result.losses) == 40 and result.final_loss < result.losses[0]
    assert result.agreement_after > result.agreement_before
    assert all(p.grad is None for p in model.parameters())
    out = sm.generate(prompt, max_new_tokens=40)
    assert torch.equal(out, hf_greedy(model, prompt, 40))


def test_losses_are_zero_at_the_target():
    h = torch.randn(2, 5, 8)
    logits = torch.randn(2, 5, 11)
    reg, cls = eagle_losses(h, logits, h, logits)
    assert float(reg) == 0.0
    assert float(cls) <= float(eagle_losses(h, torch.zeros_like(logits), h, logits)[1])


def test_parts_round_trip(tmp_path):
    model = tiny_model("gemma", layers=3, seed=5)
    tokens = torch.randint(0, 128, (200,), generator=torch.Generator().manual_seed(0))
    sm = rewrite.apply(model, "eagle", max_draft_tokens=4, confidence_threshold=0.5)
    sm.fit(tokens, steps=3, batch_size=2, seq_len=16, lr=1e-2, progress=False)
    path = sm.save_parts(tmp_path / "parts")
    # the head's two files, and the training data's token ranking (draft_vocab)
    names = sorted(p.name for p in path.iterdir())
    assert names == ["draft_vocab.safetensors", "eagle_head.json", "eagle_head.safetensors"]
    meta = json.loads((path / "eagle_head.json").read_text())
    assert meta["recipe"] == "eagle" and meta["init_layer"] == 2
    assert meta["options"]["max_draft_tokens"] == 4 and "parts" not in meta["options"]
    loaded = rewrite.apply(model, "eagle", parts=path)
    assert loaded.options.max_draft_tokens == 4 and loaded.options.confidence_threshold == 0.5
    a = eagle_head_of(sm.graph_module).state_dict()
    b = eagle_head_of(loaded.graph_module).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    prompt = torch.tensor([[7, 8, 9]])
    assert torch.equal(sm.generate(prompt, max_new_tokens=16),
                       loaded.generate(prompt, max_new_tokens=16))  # fmt: skip
    assert (
        rewrite.apply(model, "eagle", parts=path, max_draft_tokens=2).options.max_draft_tokens == 2
    )


def test_parts_errors(tmp_path):
    model = tiny_model("llama", layers=3)
    with pytest.raises(ValueError, match="parts: .* holds no EAGLE head"):
        rewrite.apply(model, "eagle", parts=tmp_path)
    sm = rewrite.apply(tiny_model("llama", layers=4), "eagle")
    sm.save_parts(tmp_path / "other")
    with pytest.raises(ValueError, match="parts: .* trained for another model: num_hidden_layers"):
        rewrite.apply(model, "eagle", parts=tmp_path / "other")
    sm = rewrite.apply(model, "eagle", init_layer=1)
    sm.save_parts(tmp_path / "layer1")
    with pytest.raises(ValueError, match="init_layer: 2 does not match the head .* layer 1"):
        rewrite.apply(model, "eagle", parts=tmp_path / "layer1", init_layer=2)
    wide = tiny_model("llama", layers=3, head_dim=16)
    with pytest.raises(ValueError, match="parts: .* trained for another model: head_dim=8"):
        rewrite.apply(wide, "eagle", parts=tmp_path / "layer1")


@pytest.mark.parametrize(
    ("option", "value", "message"),
    [
        ("max_draft_tokens", 0, "max_draft_tokens: 0 is invalid"),
        ("confidence_threshold", 1.0, r"confidence_threshold: 1.0 is invalid; allowed: .*\[0, 1\)"),
        ("fuse_layers", "yes", "fuse_layers: 'yes' is invalid"),
        ("exit_layer", 2, "'exit_layer' is not an option of recipe 'eagle'"),
    ],
)
def test_option_errors(option, value, message):
    with pytest.raises(ValueError, match=message):
        rewrite.apply(tiny_model("llama", layers=3), "eagle", **{option: value})


def test_fit_option_errors():
    sm = rewrite.apply(tiny_model("llama", layers=3), "eagle")
    with pytest.raises(ValueError, match="'gamma' is not an option of fit"):
        sm.fit(torch.arange(20), gamma=3)
    with pytest.raises(ValueError, match="noise: -1 is invalid"):
        sm.fit(torch.arange(20), noise=-1)
    with pytest.raises(ValueError, match="reg_weight, cls_weight: both 0"):
        sm.fit(torch.arange(20), reg_weight=0, cls_weight=0)


@pytest.mark.parametrize("fuse", [True, False])
def test_fuse_layers_fuses_the_head_layer_too(fuse):
    model = tiny_model("llama", layers=3)
    sm = rewrite.apply(model, "eagle", fuse_layers=fuse)
    target = nodes_by_role(sm.graph_module, "eagle_layer")[0].target
    assert target == ("leapfx_fused.eagle_layer" if fuse else "eagle_head.layer")
    stages = eagle_stages(sm.graph_module)
    assert "eagle_head.fc" in stages["head"].code and target in stages["target"].code
    prompt = torch.tensor([[5, 6, 7, 8]])
    assert torch.equal(sm.generate(prompt, max_new_tokens=12), hf_greedy(model, prompt, 12))


@pytest.mark.slow
def test_inductor_eagle_is_token_identical_and_never_recompiles():
    """The target and head stages compile like the others (warm-up covers every shape)."""
    from tests.test_compiled import _check_compiled

    model = tiny_model("qwen2", layers=3, sliding_window=6)
    _check_compiled(model, "eagle", "dynamic", max_draft_tokens=3, confidence_threshold=0.2)


def test_bench_eagle_rows(tmp_path, capsys):
    """``leapfx bench --recipe eagle``: leapfx_kangaroo and leapfx_eagle beside the baselines,
    lossless, with the eagle head's cost ratios and its parts in the JSON."""
    from leapfx.cli import main
    from leapfx.train.data import byte_tokenizer

    tok = byte_tokenizer()
    model = tiny_model("llama", layers=4, vocab=len(tok), eos=tok.eos_token_id)
    model.save_pretrained(tmp_path / "ckpt")
    tok.save_pretrained(tmp_path / "ckpt")
    rewrite.apply(model, "eagle", max_draft_tokens=3).save_parts(tmp_path / "parts")
    out = tmp_path / "bench.json"
    argv = ["bench", "--model", str(tmp_path / "ckpt"), "--recipe", "eagle", "--prompts", "1",
            "--max-new-tokens", "10", "--repeats", "1", "--warmup", "0", "--quiet",
            "--eagle-parts", str(tmp_path / "parts"), "--json", str(out)]  # fmt: skip
    assert main(argv) == 0
    rows = {r["system"]: r for r in json.loads(out.read_text())}
    assert list(rows)[-3:] == ["leapfx_kangaroo", "leapfx_eagle", "leapfx_eagle_lookup"]
    eagle = rows["leapfx_eagle"]
    assert eagle["run"]["eagle_parts"] == str(tmp_path / "parts")
    assert all(rows[n]["identical_to_greedy"] for n in list(rows)[-3:])
    assert len(eagle["ctar"]) == 3  # the parts' d
    assert "leapfx_eagle" in capsys.readouterr().out


def test_train_eagle_cli_checks_its_options_first(tmp_path, capsys):
    from leapfx.cli import main

    assert main(["train-eagle", "--out", str(tmp_path / "h"), "--steps", "0"]) == 2
    assert "steps: 0 is invalid; allowed: an integer >= 1" in capsys.readouterr().err
    assert main(["train-eagle", "--out", str(tmp_path / "h"), "--minutes", "-1"]) == 2
    assert "max_minutes: -1.0 is invalid" in capsys.readouterr().err
    assert not (tmp_path / "h").exists()
