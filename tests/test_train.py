"""Tests of leapfx.train: LayerSkip formulas, per-sample layer dropout, the trainer, the data."""

# ruff: noqa: E741  -- ``l`` is the paper's layer index

from __future__ import annotations

import dataclasses
import json
import math
import re

import pytest
import torch
import torch.nn.functional as F

from leapfx.train import (
    CorpusSplit,
    Document,
    LayerSkipTrainConfig,
    LayerSkipTrainer,
    ReferenceModelSpec,
    TrainerConfig,
    byte_tokenizer,
    dropout_rate,
    enabled_exit_layers,
    encode_documents,
    evaluate_exits,
    exit_logits,
    exit_loss_scales,
    held_out_prompts,
    is_held_out,
    layerskip_loss,
    load_text_documents,
    lr_at,
    run_decoder,
    stdlib_corpus,
    stdlib_files,
    train_bpe_tokenizer,
    train_reference,
)
from leapfx.train.data import EXCLUDED_DIRS, stdlib_root
from leapfx.train.layerskip import scales_for


def tiny_model(model_type: str = "llama", *, layers: int = 3, vocab: int = 64, seed: int = 0, **kw):
    from transformers import AutoConfig, AutoModelForCausalLM

    args = dict(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=256,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=2,
    )
    args.update(kw)
    config = AutoConfig.for_model(model_type, **args)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config)


# -- formulas ----------------------------------------------------------------------------------


@pytest.mark.parametrize("L,T", [(2, 10), (8, 100), (16, 3)])
def test_dropout_rate_is_eq_2_to_4(L, T):
    p_max = 0.2
    for l in range(L):
        for t in range(T):
            d = math.exp(l * math.log(2) / (L - 1)) - 1
            s = math.exp(t * math.log(2) / (T - 1)) - 1
            got = dropout_rate(l, t, num_layers=L, total_steps=T, p_max=p_max, curriculum="exp")
            assert got == pytest.approx(s * d * p_max, abs=1e-12)
            none = dropout_rate(l, t, num_layers=L, total_steps=T, p_max=p_max, curriculum="none")
            assert none == pytest.approx(d * p_max, abs=1e-12)
    # D(0) = 0, D(L-1) = 1, S_exp(0) = 0, S_exp(T-1) = 1
    assert dropout_rate(0, T - 1, num_layers=L, total_steps=T, p_max=p_max) == 0.0
    assert dropout_rate(L - 1, 0, num_layers=L, total_steps=T, p_max=p_max) == 0.0
    last = dropout_rate(L - 1, T - 1, num_layers=L, total_steps=T, p_max=p_max)
    assert last == pytest.approx(p_max)


def test_exit_loss_scales_are_eq_6():
    L, e_scale = 5, 0.5
    # e(l) = e_scale * sum_{i<=l} i for l < L-1; e(L-1) = L-1 + e_scale * sum_{i<=L-2} i
    e = [0.0, 0.5, 1.5, 3.0, 4 + 0.5 * 6]
    got = exit_loss_scales(0, num_layers=L, total_steps=10, e_scale=e_scale, curriculum="all")
    assert got == pytest.approx([x / sum(e) for x in e])
    # Rotational R=2 at t=1: layers 1, 3 (+ the last) enabled.
    got = exit_loss_scales(
        1, num_layers=L, total_steps=10, e_scale=e_scale, curriculum="rotational", rotation=2
    )
    on = [0.0, e[1], 0.0, e[3], e[4]]
    assert got == pytest.approx([x / sum(on) for x in on])
    assert sum(got) == pytest.approx(1.0)
    # e_scale = 0: only the last layer's loss remains.
    got = exit_loss_scales(3, num_layers=L, total_steps=10, e_scale=0.0, curriculum="all")
    assert got == [0.0, 0.0, 0.0, 0.0, 1.0]


def test_focus_exit_takes_its_share_and_the_rest_keeps_eq_6_proportions():
    L, e_scale = 5, 0.5
    e = [0.0, 0.5, 1.5, 3.0, 4 + 0.5 * 6]
    got = exit_loss_scales(0, num_layers=L, total_steps=10, e_scale=e_scale, curriculum="all",
                           focus_exit=2, focus_share=0.25)  # fmt: skip
    rest = [x if l != 1 else 0.0 for l, x in enumerate(e)]  # E = 2 is layer index 1
    want = [x / sum(rest) * 0.75 for x in rest]
    want[1] = 0.25
    assert got == pytest.approx(want) and sum(got) == pytest.approx(1.0)
    # Rotational R=2 at t=0 enables layers 0, 2 and the last: E = 2 is off, eq. 6 as is.
    kw = dict(num_layers=L, total_steps=10, e_scale=e_scale, curriculum="rotational", rotation=2)
    assert exit_loss_scales(0, focus_exit=2, focus_share=0.25, **kw) == exit_loss_scales(0, **kw)
    # Through the recipe config, as the trainer calls it.
    config = LayerSkipTrainConfig(e_scale=e_scale, exit_curriculum="all", focus_exit=2,
                                  focus_share=0.25)  # fmt: skip
    assert scales_for(0, num_layers=L, total_steps=10, config=config) == pytest.approx(want)


@pytest.mark.parametrize(
    ("options", "says"),
    [
        ({"focus_exit": 2}, "give both or neither"),
        ({"focus_share": 0.2}, "give both or neither"),
        ({"focus_exit": 0, "focus_share": 0.2}, "focus_exit: got 0; expected an int >= 1"),
        ({"focus_exit": 2, "focus_share": 1.0}, "focus_share: got 1.0; allowed range is 0 <"),
    ],
)
def test_focus_options_are_checked(options, says):
    with pytest.raises(ValueError, match=re.escape(says)):
        LayerSkipTrainConfig(**options)


def test_focus_exit_past_the_model_is_refused_before_anything_is_written(tmp_path, capsys):
    from leapfx.cli import main

    out = tmp_path / "run"
    args = ["train-reference", str(out), "--focus-exit", "16", "--focus-share", "0.2"]
    assert main(args) == 2
    assert "focus_exit: got 16; allowed range is 1 <= focus_exit < 16" in capsys.readouterr().err
    assert not out.exists()
    with pytest.raises(ValueError, match="allowed range is 1 <= focus_exit < 5"):
        exit_loss_scales(0, num_layers=5, total_steps=10, e_scale=1.0, focus_exit=5,
                         focus_share=0.2)  # fmt: skip


def test_rotational_curriculum():
    kw = dict(num_layers=8, total_steps=100, curriculum="rotational", rotation=3)
    assert enabled_exit_layers(0, **kw) == [0, 3, 6, 7]
    assert enabled_exit_layers(1, **kw) == [1, 4, 7]
    assert enabled_exit_layers(2, **kw) == [2, 5, 7]
    assert enabled_exit_layers(3, **kw) == enabled_exit_layers(0, **kw)
    assert enabled_exit_layers(0, **kw, train_last_layer=False) == [0, 3, 6]
    # Each layer is enabled exactly once every R steps.
    for l in range(7):
        hits = [t for t in range(30) if l in enabled_exit_layers(t, **kw, train_last_layer=False)]
        assert all(b - a == 3 for a, b in zip(hits, hits[1:], strict=False)) and hits
    # R = None means L - 1, the paper's pretraining choice.
    cfg = LayerSkipTrainConfig()
    assert cfg.rotation_for(8) == 7


def test_gradual_curriculum():
    # L = 4, T = 80: one more layer every T / 2L = 10 steps, from L-1 down to 0.
    kw = dict(num_layers=4, total_steps=80, curriculum="gradual", train_last_layer=False)
    assert enabled_exit_layers(0, **kw) == [3]
    assert enabled_exit_layers(9, **kw) == [3]
    assert enabled_exit_layers(10, **kw) == [2, 3]
    assert enabled_exit_layers(19, **kw) == [2, 3]
    assert enabled_exit_layers(20, **kw) == [1, 2, 3]
    assert enabled_exit_layers(30, **kw) == [0, 1, 2, 3]
    assert enabled_exit_layers(79, **kw) == [0, 1, 2, 3]
    all_kw = dict(num_layers=4, total_steps=80, curriculum="all")
    assert enabled_exit_layers(0, **all_kw) == [0, 1, 2, 3]


# -- the decoder with per-sample layer dropout --------------------------------------------------


@pytest.mark.parametrize(
    "model_type,kw",
    [
        ("llama", {}),
        ("llama", {"attn_implementation": "eager"}),
        ("mistral", {"sliding_window": 4}),
        ("qwen2", {"sliding_window": 4, "use_sliding_window": True, "max_window_layers": 1}),
        ("qwen3", {}),
        ("phi3", {}),
        ("gemma", {}),
    ],
)
def test_run_decoder_matches_hf(model_type, kw):
    model = tiny_model(model_type, **kw).eval()
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = model(ids).logits
        out = exit_logits(model, run_decoder(model, ids)[-1])
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-5)


def test_dropped_layer_is_skipped_only_for_dropped_samples():
    model = tiny_model(layers=3).eval()
    ids = torch.randint(0, 64, (3, 10), generator=torch.Generator().manual_seed(2))
    keep = torch.ones(3, 3, dtype=torch.bool)
    keep[1, 1] = False  # layer 1 skipped for sample 1 only
    with torch.no_grad():
        full = run_decoder(model, ids)
        hs = run_decoder(model, ids, keep)
        alone = run_decoder(model, ids[1:2], keep[:, 1:2])  # sample 1 by itself
    for b in (0, 2):  # the other samples ran every layer
        for l in range(3):
            torch.testing.assert_close(hs[l][b], full[l][b], rtol=0, atol=1e-6)
    torch.testing.assert_close(hs[0][1], full[0][1], rtol=0, atol=1e-6)
    assert torch.equal(hs[1][1], hs[0][1])  # x_2 = x_1: layer 1 did nothing for sample 1
    assert not torch.allclose(hs[1][1], full[1][1])
    torch.testing.assert_close(hs[2][1], alone[2][0], rtol=0, atol=1e-6)
    # All of a layer dropped: the layer is the identity for the whole batch.
    keep_none = torch.ones(3, 3, dtype=torch.bool)
    keep_none[2] = False
    with torch.no_grad():
        hs = run_decoder(model, ids, keep_none)
    assert torch.equal(hs[2], hs[1])


def test_layerskip_loss_is_eq_5():
    model = tiny_model(layers=4)
    batch = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(3))
    recipe = LayerSkipTrainConfig(p_max=0.0, e_scale=0.7, exit_curriculum="all")
    out = layerskip_loss(model, batch, step=5, total_steps=10, config=recipe)
    with torch.no_grad():
        hs = run_decoder(model, batch[:, :-1])
        want = sum(
            s * F.cross_entropy(exit_logits(model, hs[l]).flatten(0, 1), batch[:, 1:].flatten())
            for l, s in enumerate(out.scales)
        )
    assert float(out.loss.detach()) == pytest.approx(float(want), rel=1e-5)
    assert out.keep.all() and set(out.layer_losses) == {1, 2, 3}  # e(0) = 0


@pytest.mark.parametrize("beta", [1.0, 0.25])
def test_exit_distill_is_kl_to_the_detached_last_layer(beta):
    model = tiny_model(layers=4)
    batch = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(3))
    recipe = LayerSkipTrainConfig(p_max=0.0, e_scale=0.7, exit_curriculum="all",
                                  exit_distill=beta)  # fmt: skip
    out = layerskip_loss(model, batch, step=5, total_steps=10, config=recipe)
    targets = batch[:, 1:].flatten()
    with torch.no_grad():
        hs = run_decoder(model, batch[:, :-1])
        last = F.log_softmax(exit_logits(model, hs[-1]), -1).flatten(0, 1)  # [N, V]
        want = out.scales[-1] * F.cross_entropy(exit_logits(model, hs[-1]).flatten(0, 1), targets)
        for l, s in enumerate(out.scales[:-1]):
            logits = exit_logits(model, hs[l]).flatten(0, 1)
            kl = F.kl_div(F.log_softmax(logits, -1), last, log_target=True, reduction="batchmean")
            want = want + s * ((1 - beta) * F.cross_entropy(logits, targets) + beta * kl)
    assert float(out.loss.detach()) == pytest.approx(float(want), rel=1e-5)
    # layer_losses stay the labels' CE, whatever the objective
    with torch.no_grad():
        ce1 = F.cross_entropy(exit_logits(model, hs[1]).flatten(0, 1), targets)
    assert out.layer_losses[1] == pytest.approx(float(ce1), rel=1e-5)
    # The teacher gets no gradient from the distillation terms: at a step where only an early
    # exit is weighted (rotation 2 at t = 0 enables layers 0 and 2 of 4; e(0) = 0), the last
    # layer's parameters, reached only through the teacher, get none.
    model.zero_grad()
    only_exits = LayerSkipTrainConfig(
        p_max=0.0, e_scale=0.7, exit_curriculum="rotational", rotation=2,
        train_last_layer=False, exit_distill=1.0,
    )  # fmt: skip
    out = layerskip_loss(model, batch, step=0, total_steps=10, config=only_exits)
    assert out.scales == [0.0, 0.0, 1.0, 0.0]
    out.loss.backward()
    last_layer = list(model.model.layers[-1].parameters())
    assert all(p.grad is None or not p.grad.any() for p in last_layer)
    assert model.model.layers[0].self_attn.q_proj.weight.grad.abs().sum() > 0


def test_exit_distill_option_is_checked():
    with pytest.raises(ValueError, match=re.escape("exit_distill: got 1.5; allowed range is 0 <=")):
        LayerSkipTrainConfig(exit_distill=1.5)


# -- trainer -----------------------------------------------------------------------------------


def _stream(vocab: int = 64, n: int = 4000) -> torch.Tensor:
    pattern = torch.randint(3, vocab, (37,), generator=torch.Generator().manual_seed(4))
    return pattern.repeat(n // 37 + 1)[:n].to(torch.int32)


def _config(**kw) -> TrainerConfig:
    base = dict(
        steps=6,
        batch_size=4,
        seq_len=16,
        lr=3e-3,
        warmup_steps=2,
        checkpoint_every=3,
        progress=False,
        log_every=1,
    )
    base.update(kw)
    return TrainerConfig(**base)


RECIPE = LayerSkipTrainConfig(p_max=0.5, e_scale=1.0, exit_curriculum="rotational", rotation=2)


def test_training_reduces_loss(tmp_path):
    torch.manual_seed(0)
    model = tiny_model(layers=3)
    stream = _stream()
    before = evaluate_exits(model, stream, seq_len=16, max_tokens=256)
    trainer = LayerSkipTrainer(
        model,
        stream,
        out_dir=tmp_path,
        config=_config(steps=40, checkpoint_every=0, lr=1e-2),
        recipe=RECIPE,
    )
    result = trainer.train()
    after = evaluate_exits(model, stream, seq_len=16, max_tokens=256)
    assert result.finished and result.step == 40
    assert after.loss[3] < before.loss[3] - 1.0
    assert after.loss[2] < before.loss[2] - 1.0  # the early exit learned too
    assert after.agreement[3] == 1.0
    logged = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(logged) == 40 and logged[-1]["loss"] < logged[0]["loss"]


def _weights(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_checkpoint_resume_round_trip(tmp_path):
    from transformers import AutoModelForCausalLM

    stream = _stream()
    tok = byte_tokenizer()
    straight = tiny_model(seed=0)
    LayerSkipTrainer(
        straight, stream, out_dir=tmp_path / "a", config=_config(), recipe=RECIPE, tokenizer=tok
    ).train()

    # Interrupted run: 3 steps and a checkpoint, then a fresh process with another init resumes.
    first = tiny_model(seed=0)
    trainer = LayerSkipTrainer(
        first, stream, out_dir=tmp_path / "b", config=_config(), recipe=RECIPE
    )
    for _ in range(3):
        trainer.train_step()
    ckpt = trainer.save_checkpoint()
    assert sorted(p.name for p in ckpt.iterdir()) == [
        "model.safetensors",
        "optimizer.safetensors",
        "trainer_state.json",
    ]
    second = tiny_model(seed=123)
    resumed = LayerSkipTrainer(
        second, stream, out_dir=tmp_path / "b", config=_config(), recipe=RECIPE, tokenizer=tok
    )
    assert resumed.load_checkpoint()
    assert resumed.step == 3
    for k, v in _weights(first).items():
        assert torch.equal(second.state_dict()[k], v), k
    opt_a, opt_b = trainer.optimizer.state_dict(), resumed.optimizer.state_dict()
    for idx, state in opt_a["state"].items():
        for key, value in state.items():
            assert torch.equal(torch.as_tensor(opt_b["state"][idx][key]), torch.as_tensor(value))
    result = resumed.train()
    assert result.finished and result.step == 6
    for k, v in _weights(straight).items():
        assert torch.equal(second.state_dict()[k], v), k

    # The final directory loads with the HF auto classes; no temporary directory is left over.
    final = tmp_path / "b" / "model"
    loaded = AutoModelForCausalLM.from_pretrained(final, dtype=torch.float32)
    for k, v in second.state_dict().items():
        assert torch.equal(loaded.state_dict()[k], v), k
    leftovers = [p.name for p in (tmp_path / "b").rglob(".*")]
    assert leftovers == []
    assert len(list((tmp_path / "b" / "checkpoints").iterdir())) == 2  # keep_checkpoints

    # Resuming with options that change the run is refused, naming the option.
    other = LayerSkipTrainer(
        tiny_model(), stream, out_dir=tmp_path / "b", config=_config(lr=1e-4), recipe=RECIPE
    )
    with pytest.raises(ValueError, match="trainer.lr"):
        other.load_checkpoint()


def test_lr_schedule():
    cfg = _config(steps=100, warmup_steps=10, lr=1.0, min_lr_ratio=0.1)
    assert lr_at(0, cfg) == pytest.approx(0.1)
    assert lr_at(9, cfg) == pytest.approx(1.0)
    assert lr_at(10, cfg) == pytest.approx(1.0)
    assert lr_at(55, cfg) == pytest.approx(0.55)
    assert lr_at(100, cfg) == pytest.approx(0.1)


# -- data --------------------------------------------------------------------------------------


def test_stdlib_split_is_deterministic_and_disjoint_by_file():
    files = stdlib_files()
    assert len(files) > 300
    assert not any(EXCLUDED_DIRS.intersection(f.split("/")[:-1]) for f in files)
    assert not any(f.startswith(("test/", "idlelib/idle_test/", "lib2to3/tests/")) for f in files)
    a, b = stdlib_corpus(), stdlib_corpus()
    names_train = [d.name for d in a.train]
    names_held = [d.name for d in a.held_out]
    assert names_train == [d.name for d in b.train] and names_held == [d.name for d in b.held_out]
    assert set(names_train).isdisjoint(names_held)
    assert sorted(names_train + names_held) == files
    assert 0.02 < len(names_held) / len(files) < 0.1
    # The split of a file depends on its path only.
    assert all(is_held_out(n, 0.05) for n in names_held)
    assert not any(is_held_out(n, 0.05) for n in names_train)


def test_load_text_documents(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "a.txt").write_text("alpha")
    (tmp_path / "sub" / "b.py").write_text("beta")
    (tmp_path / ".hidden").write_text("no")
    docs = load_text_documents(tmp_path)
    assert [(d.name, d.text) for d in docs] == [("a.txt", "alpha"), ("sub/b.py", "beta")]
    assert [d.name for d in load_text_documents(tmp_path, suffixes=[".py"])] == ["sub/b.py"]
    assert load_text_documents(tmp_path / "a.txt") == [Document("a.txt", "alpha")]
    with pytest.raises(ValueError, match="path"):
        load_text_documents(tmp_path / "missing")


TEXT = 'def f(x):\n\tif x:  # ünïcode ✓\n        return "a\\nb"\r\n    return None\n'


@pytest.mark.parametrize("kind", ["byte", "bpe"])
def test_tokenizer_round_trip_and_autotokenizer(tmp_path, kind):
    from transformers import AutoTokenizer

    if kind == "byte":
        tok = byte_tokenizer()
        assert tok("hi")["input_ids"] == [256, 104, 105]
        assert len(tok) == 259
    else:
        docs = [d.text for d in stdlib_corpus().train[:40]]
        tok = train_bpe_tokenizer(docs, vocab_size=400)
        assert len(tok) == 400
    ids = tok(TEXT)["input_ids"]
    assert ids[0] == tok.bos_token_id
    assert tok.decode(ids, skip_special_tokens=True) == TEXT
    tok.save_pretrained(tmp_path)
    again = AutoTokenizer.from_pretrained(tmp_path)
    assert again(TEXT)["input_ids"] == ids
    assert again.decode(ids, skip_special_tokens=True) == TEXT
    assert (again.bos_token, again.eos_token, again.pad_token) == ("<bos>", "<eos>", "<pad>")
    stream = encode_documents(again, [Document("a", "x"), Document("b", "yz")])
    assert stream.tolist()[-1] == again.eos_token_id


def test_held_out_prompts():
    src = (
        "import os\n\n"
        "def first(a, b):\n    total = a + b\n    return total * 2\n\n"
        "class K:\n    def method(self):\n        return [i for i in range(10)]\n\n"
        "def t(): pass\n"
    )
    corpus = CorpusSplit(
        train=[], held_out=[Document("m.py", src), Document("z.py", "x=1\n")], root=""
    )
    tok = byte_tokenizer()
    prompts = list(held_out_prompts(tok, corpus, num_tokens=16, count=10))
    assert [p.name for p in prompts] == ["m.py:first:3", "m.py:K.method:8"]
    assert prompts[1].text == "def method(self"  # dedented; <bos> + 15 bytes
    for p in prompts:
        assert len(p.input_ids) == 16 and p.input_ids[0] == tok.bos_token_id
        assert p.source.startswith(p.text)
    assert len(list(held_out_prompts(tok, corpus, num_tokens=16, count=1))) == 1
    assert list(held_out_prompts(tok, corpus, num_tokens=16, count=10)) == prompts


# -- validation --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "cls,kw,option",
    [
        (LayerSkipTrainConfig, {"p_max": 1.5}, "p_max"),
        (LayerSkipTrainConfig, {"p_max": -0.1}, "p_max"),
        (LayerSkipTrainConfig, {"e_scale": 2.0}, "e_scale"),
        (LayerSkipTrainConfig, {"dropout_curriculum": "linear"}, "dropout_curriculum"),
        (LayerSkipTrainConfig, {"exit_curriculum": "random"}, "exit_curriculum"),
        (LayerSkipTrainConfig, {"rotation": 0}, "rotation"),
        (LayerSkipTrainConfig, {"rotation": 2.5}, "rotation"),
        (TrainerConfig, {"steps": 0}, "steps"),
        (TrainerConfig, {"lr": 0.0}, "lr"),
        (TrainerConfig, {"grad_clip": -1.0}, "grad_clip"),
        (TrainerConfig, {"max_minutes": 0}, "max_minutes"),
        (TrainerConfig, {"save_dtype": "int8"}, "save_dtype"),
        (ReferenceModelSpec, {"tokenizer": "words"}, "tokenizer"),
        (ReferenceModelSpec, {"num_heads": 5}, "num_heads"),
    ],
)
def test_bad_options_raise_value_error_naming_the_option(cls, kw, option):
    with pytest.raises(ValueError, match=option) as info:
        cls(**kw)
    assert repr(next(iter(kw.values()))) in str(info.value)


def test_formula_arguments_are_checked():
    with pytest.raises(ValueError, match="num_layers"):
        dropout_rate(0, 0, num_layers=1, total_steps=10, p_max=0.1)
    with pytest.raises(ValueError, match="t: got 10"):
        dropout_rate(0, 10, num_layers=4, total_steps=10, p_max=0.1)
    with pytest.raises(ValueError, match="curriculum"):
        enabled_exit_layers(0, num_layers=4, total_steps=10, curriculum="zigzag")


# -- end to end --------------------------------------------------------------------------------


def test_train_reference_end_to_end_tiny(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    spec = ReferenceModelSpec(
        num_layers=3,
        hidden_size=32,
        intermediate_size=64,
        num_heads=2,
        num_kv_heads=1,
        tokenizer="byte",
    )
    report = train_reference(
        tmp_path,
        minutes=2,
        spec=spec,
        steps=3,
        batch_size=2,
        seq_len=32,
        eval_tokens=256,
        progress=False,
    )
    final = tmp_path / "model"
    on_disk = json.loads((final / "reference_report.json").read_text())
    assert on_disk == report
    assert report["training"]["steps"] == 3 and report["training"]["finished"]
    assert set(report["exits"]) == {"1", "2", "3"}
    assert report["exits"]["3"]["agreement_top1"] == 1.0
    assert report["held_out"]["bits_per_byte"] > 0
    model = AutoModelForCausalLM.from_pretrained(final)
    assert model.dtype == torch.float16
    assert AutoTokenizer.from_pretrained(final)("a")["input_ids"] == [256, 97]
    # Where it ran and what it read.
    assert report["training"]["device"] == "cpu"
    assert report["training"]["torch"] == torch.__version__
    assert report["training"]["trainer"]["device"] == "cpu"
    assert report["corpus"]["files"] == len(stdlib_files())
    assert report["corpus"]["root"] == str(stdlib_root().resolve())
    assert len(report["corpus"]["sha256"]) == 64


def test_train_reference_distill_phase_tiny(tmp_path):
    from transformers import AutoModelForCausalLM

    from leapfx.train.reference import REFERENCE_DISTILL_RECIPE

    spec = ReferenceModelSpec(num_layers=4, hidden_size=32, intermediate_size=64, num_heads=2,
                              num_kv_heads=1)  # fmt: skip
    recipe = dataclasses.replace(REFERENCE_DISTILL_RECIPE, focus_exit=2)
    kw = dict(
        minutes=2, spec=spec, steps=3, batch_size=2, seq_len=32, eval_tokens=256, progress=False,
        distill_minutes=0.5, distill_recipe=recipe, distill_steps=2,
    )  # fmt: skip
    report = train_reference(tmp_path, **kw)
    distill = report["distill"]
    assert distill["steps"] == 2 and distill["finished"]
    assert distill["recipe"]["exit_distill"] == 1.0 and distill["trainer"]["lr"] == 3e-4
    assert distill["trainer"]["seed"] == report["training"]["seed"] + 1
    assert report["training"]["steps"] == 3
    pretrained = AutoModelForCausalLM.from_pretrained(tmp_path / "pretrained")
    final = AutoModelForCausalLM.from_pretrained(tmp_path / "model")
    moved = [
        not torch.equal(a, b)
        for a, b in zip(pretrained.parameters(), final.parameters(), strict=True)
    ]
    assert any(moved)  # the reported model is the finetuned one
    saved = json.loads((tmp_path / "model" / "leapfx_training.json").read_text())
    assert saved["step"] == 2 and saved["recipe"]["exit_distill"] == 1.0
    # Run again: both phases resume at their ends and the same model comes out.
    again = train_reference(tmp_path, **kw)
    assert again["distill"]["steps"] == 2 and again["exits"] == report["exits"]


def test_bad_distill_minutes_is_refused_before_anything_is_written(tmp_path, capsys):
    from leapfx.cli import main

    out = tmp_path / "run"
    assert main(["train-reference", str(out), "--minutes", "10", "--distill-minutes", "10"]) == 2
    err = capsys.readouterr().err
    assert "distill_minutes: got 10.0; allowed range is 0 <= distill_minutes < minutes" in err
    assert not out.exists()


# -- devices and corpus roots (CPU only: no CUDA code runs here) -------------------------------

NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available here")


@pytest.mark.parametrize(
    "device,says",
    [
        pytest.param("cuda", "but CUDA is not available here", marks=NO_CUDA),
        pytest.param("cuda:1", "but CUDA is not available here", marks=NO_CUDA),
        ("gpu", "which torch does not accept"),
        ("meta", "allowed: 'cpu' or a CUDA device"),
    ],
)
def test_bad_device_is_refused_before_anything_is_written(tmp_path, capsys, device, says):
    from leapfx.cli import main

    out = tmp_path / "run"
    with pytest.raises(ValueError, match=f"device: got {device!r}") as info:
        train_reference(out, minutes=1, steps=2, progress=False, device=device)
    assert says in str(info.value) and "allowed: 'cpu' or a CUDA device" in str(info.value)
    assert not out.exists()
    with pytest.raises(ValueError, match=f"device: got {device!r}"):
        TrainerConfig(device=device)
    assert main(["train-reference", str(out), "--device", device]) == 2
    assert f"device: got {device!r}" in capsys.readouterr().err
    assert not out.exists()


def test_kangaroo_example_refuses_a_bad_device_before_writing(tmp_path, monkeypatch):
    import runpy
    import sys
    from pathlib import Path

    script = Path(__file__).parents[1] / "examples" / "train_kangaroo_adapter.py"
    out = tmp_path / "adapter"
    monkeypatch.setattr(sys, "argv", [str(script), "--device", "gpu", "--out", str(out)])
    with pytest.raises(ValueError, match="--device: got 'gpu'"):
        runpy.run_path(str(script), run_name="__main__")
    missing = tmp_path / "missing"
    argv = [str(script), "--corpus-root", str(missing), "--out", str(out)]
    monkeypatch.setattr(sys, "argv", argv)
    with pytest.raises(ValueError, match="--corpus-root: got"):
        runpy.run_path(str(script), run_name="__main__")
    assert not out.exists()


def test_device_is_a_runtime_option_of_a_checkpoint(tmp_path):
    stream = _stream()
    trainer = LayerSkipTrainer(
        tiny_model(), stream, out_dir=tmp_path, config=_config(), recipe=RECIPE
    )
    trainer.train_step()
    trainer.save_checkpoint()
    state = json.loads((trainer.checkpoints()[-1] / "trainer_state.json").read_text())
    assert state["config"]["device"] == "cpu" and "device" not in state["trainer"]
    # Another device string resumes the same run (the tensors were written from the CPU).
    other = LayerSkipTrainer(
        tiny_model(seed=5), stream, out_dir=tmp_path, config=_config(device="cpu:0"), recipe=RECIPE
    )
    assert other.load_checkpoint() and other.step == 1
    for k, v in _weights(trainer.model).items():
        assert torch.equal(other.model.state_dict()[k], v), k


def test_corpus_root_at_the_stdlib_or_a_copy_gives_the_default_split(tmp_path):
    import shutil

    from leapfx.train.reference import corpus_digest, reference_corpus

    default = reference_corpus()
    same = reference_corpus(stdlib_root())
    names = ([d.name for d in default.train], [d.name for d in default.held_out])
    assert ([d.name for d in same.train], [d.name for d in same.held_out]) == names
    # A copy of the corpus files elsewhere (what another machine reads) gives the same corpus.
    copy_root = tmp_path / "stdlib-copy"
    for rel in stdlib_files():
        (copy_root / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(stdlib_root() / rel, copy_root / rel)
    assert stdlib_files(copy_root) == stdlib_files()
    copied = reference_corpus(copy_root)
    assert ([d.name for d in copied.train], [d.name for d in copied.held_out]) == names
    assert corpus_digest(copied) == corpus_digest(default) == corpus_digest(same)
    (copy_root / "extra.py").write_text("x = 1\n")
    assert corpus_digest(reference_corpus(copy_root)) != corpus_digest(default)


def test_missing_or_empty_corpus_root_is_refused(tmp_path):
    from leapfx.train.reference import reference_corpus

    missing = tmp_path / "missing"
    out = tmp_path / "run"
    with pytest.raises(ValueError, match="corpus_root: got .*missing.*not a folder"):
        train_reference(out, minutes=1, steps=2, progress=False, corpus_root=missing)
    assert not out.exists()
    with pytest.raises(ValueError, match="root: .*missing.*is not a folder"):
        stdlib_files(missing)
    with pytest.raises(ValueError, match="root: .*missing"):
        stdlib_corpus(root=missing)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="corpus_root: .*empty.* gives 0 training"):
        reference_corpus(tmp_path / "empty")


def test_kangaroo_fit_refuses_an_adapter_on_another_device():
    from leapfx import rewrite

    model = tiny_model(layers=4).eval()
    sm = rewrite.apply(model, "kangaroo", exit_layer=2)
    model.to("meta")  # moved after apply: the adapter stayed on the CPU
    with pytest.raises(ValueError, match="adapter is on cpu but the model on meta"):
        sm.fit(_stream().long(), steps=1, progress=False)
