"""``generate`` means what HF's ``generate`` means: streamers, generation configs, processors.

Streamers follow HF's protocol (the prompt first, then each group of new tokens, then ``end()``)
on every backend; the tokens streamed are the tokens returned. Every field of
``GenerationConfig`` is honoured (checked against HF here) or refused with a ValueError naming
it. The greedy parity property runs in float64, where a float tie between the top two scores
cannot happen: every lossless recipe must equal HF's ``generate`` under the same config, full
stop.
"""

from __future__ import annotations

import functools
import threading

import pytest
import torch
from hypothesis import event, given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer, StoppingCriteria, StoppingCriteriaList, TextIteratorStreamer

from leapfx import rewrite
from leapfx.models import REFERENCE_MODEL
from leapfx.runtime.generation import HONOURED, NO_EFFECT, REFUSED
from tests.conftest import examples, tiny_model
from tests.distribution_check import assert_sampled_from, sample_counts

PROMPT = torch.tensor([[72, 101, 108, 108, 111, 32, 119]])


class RecordingStreamer:
    """Records what HF's streamer protocol hands over: ``put`` tensors, then one ``end``."""

    def __init__(self) -> None:
        self.puts: list[torch.Tensor] = []
        self.ended = 0

    def put(self, value: torch.Tensor) -> None:
        assert self.ended == 0, "put after end"
        self.puts.append(value.clone())

    def end(self) -> None:
        self.ended += 1

    def new_tokens(self) -> list[int]:
        return [t for value in self.puts[1:] for t in value.reshape(-1).tolist()]


@pytest.fixture(scope="module")
def byte_model():
    return tiny_model("llama", layers=4, vocab=259, seed=7)


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(REFERENCE_MODEL)


def _streamed(generate, prompt, **kwargs) -> tuple[torch.Tensor, RecordingStreamer]:
    streamer = RecordingStreamer()
    out = generate(prompt, streamer=streamer, **kwargs)
    return out, streamer


@pytest.mark.parametrize(
    "recipe, options",
    [("autoregressive", {}), ("layerskip", {"exit_layer": 2, "num_speculations": 3}),
     ("early_exit", {"exit_layer": 2})],
)  # fmt: skip
def test_streamer_gets_prompt_then_every_new_token_then_end(byte_model, recipe, options):
    sm = rewrite.apply(byte_model, recipe, **options)
    out, streamer = _streamed(sm.generate, PROMPT, max_new_tokens=17)
    assert torch.equal(streamer.puts[0], PROMPT)  # the prompt first, as HF does
    assert streamer.puts[0].device.type == "cpu"
    assert all(v.dim() in (1, 2) for v in streamer.puts)
    assert streamer.new_tokens() == out[0, PROMPT.shape[1] :].tolist()
    assert streamer.ended == 1
    if recipe == "layerskip" and sm.last_metrics.accepted_per_verify:
        # accepted drafts come as one group per round (more than one token at once)
        assert len(streamer.puts) - 1 < out.shape[1] - PROMPT.shape[1]


def test_text_iterator_streamer_text_equals_decoded_output(byte_model, tokenizer):
    sm = rewrite.apply(byte_model, "layerskip", exit_layer=1, num_speculations=4)
    streamer = TextIteratorStreamer(tokenizer, skip_prompt=True)
    result = {}

    def run():
        result["out"] = sm.generate(PROMPT, max_new_tokens=24, streamer=streamer)

    thread = threading.Thread(target=run)
    thread.start()
    text = "".join(streamer)
    thread.join()
    new = result["out"][0, PROMPT.shape[1] :]
    assert text == tokenizer.decode(new)


def test_streamer_stops_at_eos(byte_model):
    sm = rewrite.apply(byte_model, "layerskip", exit_layer=2, num_speculations=4)
    free = sm.generate(PROMPT, max_new_tokens=12)
    eos = int(free[0, PROMPT.shape[1] + 5])
    out, streamer = _streamed(sm.generate, PROMPT, max_new_tokens=12, eos_token_id=eos)
    assert out[0, -1] == eos
    assert streamer.new_tokens() == out[0, PROMPT.shape[1] :].tolist()


def test_onnx_streamer(byte_model, tmp_path):
    pytest.importorskip("onnxruntime")
    pytest.importorskip("onnxscript")
    from leapfx.export import OnnxModel

    model = tiny_model("llama", layers=2, vocab=64, seed=3)
    prompt = torch.tensor([[5, 9, 1, 33]])
    sm = rewrite.apply(model, "layerskip", exit_layer=1, num_speculations=3)
    sm.export_onnx(tmp_path / "onnx")
    ort_model = OnnxModel(tmp_path / "onnx")
    out, streamer = _streamed(ort_model.generate, prompt, max_new_tokens=10)
    assert torch.equal(streamer.puts[0], prompt)
    assert streamer.new_tokens() == out[0, prompt.shape[1] :].tolist()
    assert streamer.ended == 1
    # the same front end: processors, refusals and HF's output on the ONNX backend too
    kw = dict(max_new_tokens=12, repetition_penalty=1.5, no_repeat_ngram_size=2)
    assert torch.equal(ort_model.generate(prompt, **kw), sm.generate(prompt, **kw))
    out = ort_model.generate(prompt, return_dict_in_generate=True, output_scores=True, **kw)
    assert len(out.scores) == out.sequences.shape[1] - prompt.shape[1]
    assert out.metrics is ort_model.last_metrics
    with pytest.raises(ValueError, match="num_beams"):
        ort_model.generate(prompt, num_beams=2)


# -- the generation config: every field honoured or refused --------------------------------------

# Non-neutral values of every refused field.
REFUSED_VALUES = {
    "num_beams": 2, "num_return_sequences": 2, "num_beam_groups": 2, "diversity_penalty": 0.5,
    "penalty_alpha": 0.6, "low_memory": True, "dola_layers": "low", "constraints": ["c"],
    "force_words_ids": [[1]], "guidance_scale": 1.5, "token_healing": True, "use_mtp": True,
    "output_attentions": True, "output_hidden_states": True, "encoder_repetition_penalty": 1.2,
    "encoder_no_repeat_ngram_size": 2, "is_assistant": True, "continuous_batching_config": {},
    "speculation_type": "ngram", "assistant_early_exit": 2, "prompt_lookup_num_tokens": 3,
    "max_matching_ngram_size": 2, "num_assistant_tokens": 5,
    "num_assistant_tokens_schedule": "heuristic", "assistant_confidence_threshold": 0.5,
    "assistant_lookbehind": 5, "target_lookbehind": 5, "assistant_ensemble_weight": 0.5,
}  # fmt: skip
# Values of the fields that cannot change the tokens here.
NO_EFFECT_VALUES = {
    "use_cache": False, "cache_implementation": "static", "cache_config": {"max_cache_len": 64},
    "max_cache_len": 64, "compile_config": None, "disable_compile": True,
    "prefill_chunk_size": 2, "early_stopping": True, "length_penalty": 2.0,
    "decoder_start_token_id": 3, "transformers_version": "0.0", "_from_model_config": True,
}  # fmt: skip
# Honoured fields and the test that checks them against HF.
PARITY_FIELDS = {  # drawn by test_greedy_parity_with_hf_over_generation_configs
    "max_length", "max_new_tokens", "min_length", "min_new_tokens", "repetition_penalty",
    "no_repeat_ngram_size", "bad_words_ids", "forced_eos_token_id", "suppress_tokens",
    "begin_suppress_tokens", "sequence_bias", "exponential_decay_length_penalty",
    "renormalize_logits", "remove_invalid_values", "eos_token_id", "pad_token_id",
    "bos_token_id", "forced_bos_token_id", "do_sample",
}  # fmt: skip
OTHER_HONOURED = {
    "stop_strings": "test_stop_strings_equal_hf",
    "max_time": "test_max_time_and_stopping_criteria",
    "output_scores": "test_return_dict_equals_hf_for_autoregressive",
    "output_logits": "test_return_dict_equals_hf_for_autoregressive",
    "return_dict_in_generate": "test_return_dict_equals_hf_for_autoregressive",
    "temperature": "test_sampling_with_processors_has_the_target_distribution",
    "top_k": "test_sampling_with_processors_has_the_target_distribution",
    "top_p": "test_sampling_with_processors_has_the_target_distribution",
    "min_p": "test_sampling_warpers_equal_hf_under_a_seed",
    "top_h": "test_sampling_warpers_equal_hf_under_a_seed",
    "typical_p": "test_sampling_warpers_equal_hf_under_a_seed",
    "epsilon_cutoff": "test_sampling_warpers_equal_hf_under_a_seed",
    "eta_cutoff": "test_sampling_warpers_equal_hf_under_a_seed",
    "watermarking_config": "test_sampling_warpers_equal_hf_under_a_seed",
}


def test_every_generation_config_field_is_classified():
    """Fails when transformers adds a field nobody classified (or one is classified twice)."""
    from transformers import GenerationConfig

    fields = set(GenerationConfig().to_dict())
    tables = [set(HONOURED), set(NO_EFFECT), set(REFUSED)]
    assert sum(len(t) for t in tables) == len(set().union(*tables)), "a field in two tables"
    unclassified = fields - set().union(*tables)
    assert not unclassified, f"unclassified GenerationConfig fields: {sorted(unclassified)}"
    assert set(REFUSED_VALUES) == set(REFUSED)
    assert set(NO_EFFECT_VALUES) == set(NO_EFFECT)
    assert PARITY_FIELDS | set(OTHER_HONOURED) == set(HONOURED)


@pytest.mark.parametrize("field", sorted(REFUSED_VALUES))
def test_refused_fields_raise_naming_the_field(byte_model, field):
    from transformers import GenerationConfig

    sm = rewrite.apply(byte_model, "layerskip", exit_layer=2)
    with pytest.raises(ValueError, match=field):
        sm.generate(PROMPT, max_new_tokens=3, **{field: REFUSED_VALUES[field]})
    config = GenerationConfig(max_new_tokens=3)
    setattr(config, field, REFUSED_VALUES[field])  # a checkpoint's config that sets it
    with pytest.raises(ValueError, match=field):
        sm.generate(PROMPT, generation_config=config)


def test_no_effect_fields_leave_the_tokens(byte_model):
    sm = rewrite.apply(byte_model, "layerskip", exit_layer=2)
    ref = sm.generate(PROMPT, max_new_tokens=8)
    for field, value in NO_EFFECT_VALUES.items():
        if field in ("transformers_version", "_from_model_config"):
            continue  # metadata: not generate() arguments
        assert torch.equal(sm.generate(PROMPT, max_new_tokens=8, **{field: value}), ref), field


def test_unknown_and_refused_arguments_raise_value_error(byte_model):
    sm = rewrite.apply(byte_model, "autoregressive")
    with pytest.raises(ValueError, match="max_new_tokenz: unknown argument"):
        sm.generate(PROMPT, max_new_tokenz=3)
    with pytest.raises(ValueError, match="assistant_model"):
        sm.generate(PROMPT, max_new_tokens=3, assistant_model=byte_model)
    with pytest.raises(ValueError, match="generation_config"):
        sm.generate(PROMPT, generation_config={"max_new_tokens": 3})


def test_the_callers_generation_config_is_not_written(byte_model):
    from transformers import GenerationConfig

    sm = rewrite.apply(byte_model, "layerskip", exit_layer=2)
    config = GenerationConfig(max_new_tokens=6, repetition_penalty=1.3)
    before, model_before = config.to_dict(), byte_model.generation_config.to_dict()
    sm.generate(PROMPT, generation_config=config, max_new_tokens=4, no_repeat_ngram_size=2)
    assert config.to_dict() == before
    assert byte_model.generation_config.to_dict() == model_before


# -- parity with HF under logits processors ------------------------------------------------------

LOSSLESS = (
    ("autoregressive", {}),
    ("layerskip", {"exit_layer": 2, "num_speculations": 3}),
    ("kangaroo", {"exit_layer": 2}),
    ("eagle", {"max_draft_tokens": 3}),
    ("m2r2", {"fast_layers": 2}),
    ("specee", {"exit_layer": 1, "threshold": 0.0, "verify": True}),
)
VOCAB = 48


@functools.cache
def _model64(seed: int):
    return tiny_model("llama", layers=4, vocab=VOCAB, seed=seed, eos=5, dtype=torch.float64)


@functools.cache
def _applied(seed: int, recipe: str):
    return rewrite.apply(_model64(seed), recipe, **dict(LOSSLESS)[recipe])


@st.composite
def generation_configs(draw, prompt_len: int) -> dict:
    token = st.integers(0, VOCAB - 1)
    config = {}
    if draw(st.booleans(), label="max_new_tokens (else max_length)"):
        config["max_new_tokens"] = draw(st.integers(1, 14))
    else:
        config["max_length"] = prompt_len + draw(st.integers(1, 14))
    optional = {
        "min_length": st.integers(0, prompt_len + 10),
        "min_new_tokens": st.integers(0, 10),
        "repetition_penalty": st.sampled_from([0.7, 1.2, 1.5, 3.0]),
        "no_repeat_ngram_size": st.integers(1, 3),
        "bad_words_ids": st.lists(st.lists(token, min_size=1, max_size=2), min_size=1,
                                  max_size=3),
        "forced_eos_token_id": token,
        "suppress_tokens": st.lists(token, min_size=1, max_size=6),
        "begin_suppress_tokens": st.lists(token, min_size=1, max_size=6),
        "sequence_bias": st.dictionaries(st.tuples(token) | st.tuples(token, token),
                                         st.floats(-8, 8), min_size=1, max_size=4),
        "exponential_decay_length_penalty": st.tuples(st.integers(0, 6), st.floats(1.05, 2.0)),
        "renormalize_logits": st.just(True),
        "remove_invalid_values": st.just(True),
        "eos_token_id": st.one_of(st.just([]), token, st.lists(token, min_size=1, max_size=3)),
        "pad_token_id": token,
        "bos_token_id": token,
        "forced_bos_token_id": token,
    }  # fmt: skip
    for name in draw(st.sets(st.sampled_from(sorted(optional)), max_size=4), label="fields"):
        config[name] = draw(optional[name], label=name)
    if "bad_words_ids" in config:  # HF refuses a ban of the EOS token alone
        eos = config.get("eos_token_id", 5)
        eos = {eos} if isinstance(eos, int) else set(eos)
        config["bad_words_ids"] = [
            w for w in config["bad_words_ids"] if not (len(w) == 1 and w[0] in eos)
        ] or None
    return config


@settings(max_examples=examples(30, 100))
@given(data=st.data())
def test_greedy_parity_with_hf_over_generation_configs(data):
    seed = data.draw(st.integers(0, 2), label="seed")
    recipe = data.draw(st.sampled_from([name for name, _ in LOSSLESS]), label="recipe")
    ids = data.draw(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=8), label="prompt")
    prompt = torch.tensor([ids])
    config = data.draw(generation_configs(len(ids)), label="config")
    model = _model64(seed)
    try:
        ref = model.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False,
                             **config)  # fmt: skip
    except (ValueError, RuntimeError):  # a config HF refuses (or crashes on): we refuse it
        event("a config HF refuses")
        with pytest.raises(ValueError):
            _applied(seed, recipe).generate(prompt, do_sample=False, **config)
        return
    ours = _applied(seed, recipe).generate(prompt, do_sample=False, **config)
    assert ours.tolist() == ref.tolist()


@pytest.mark.parametrize("recipe", ["autoregressive", "layerskip"])
def test_min_new_tokens_overrides_min_length_as_in_hf(recipe):
    """HF's ``_prepare_generated_length``: ``min_new_tokens`` (even 0) sets ``min_length``, so
    EOS is free at once here, where ``min_length=3`` alone would hold it back a step."""
    model = _model64(0)
    prompt = torch.tensor([[2]])
    config = {"max_length": 3, "min_length": 3, "min_new_tokens": 0}
    ref = model.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False,
                         **config)  # fmt: skip
    assert ref[0, -1] == 5  # the EOS token, which min_length=3 alone would have suppressed
    assert _applied(0, recipe).generate(prompt, do_sample=False, **config).tolist() == ref.tolist()


def test_processors_hold_inside_speculation():
    """The issue's example: a penalty the model's own generation_config sets changes HF's
    output, and every lossless recipe follows it."""
    model = tiny_model("llama", layers=4, vocab=VOCAB, seed=1, dtype=torch.float64)
    prompt = torch.tensor([[7, 8, 9, 7, 8]])
    plain = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=16)
    model.generation_config.repetition_penalty = 1.5
    model.generation_config.no_repeat_ngram_size = 2
    try:
        ref = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=16)
        assert not torch.equal(ref, plain)
        for recipe, options in LOSSLESS:
            out = rewrite.apply(model, recipe, **options).generate(prompt, max_new_tokens=16)
            assert out.tolist() == ref.tolist(), recipe
    finally:
        model.generation_config.repetition_penalty = None
        model.generation_config.no_repeat_ngram_size = None


def test_stop_strings_equal_hf(byte_model, tokenizer):
    free = byte_model.generate(PROMPT, attention_mask=torch.ones_like(PROMPT), max_new_tokens=20)
    new = free[0, PROMPT.shape[1] :].tolist()
    ascii_tokens = [t for t in new[3:] if 32 < t < 127]
    assert ascii_tokens, "the fixture's continuation has a printable byte to stop at"
    stop = chr(ascii_tokens[0])
    ref = byte_model.generate(PROMPT, attention_mask=torch.ones_like(PROMPT), max_new_tokens=20,
                              stop_strings=[stop], tokenizer=tokenizer)  # fmt: skip
    assert ref.shape[1] < free.shape[1]
    for recipe, options in (("autoregressive", {}), ("layerskip", {"exit_layer": 2})):
        sm = rewrite.apply(byte_model, recipe, **options)
        out = sm.generate(PROMPT, max_new_tokens=20, stop_strings=stop, tokenizer=tokenizer)
        assert out.tolist() == ref.tolist(), recipe
        with pytest.raises(ValueError, match="tokenizer"):
            sm.generate(PROMPT, max_new_tokens=20, stop_strings=stop)


class _StopAfter(StoppingCriteria):
    def __init__(self, length: int) -> None:
        self.length = length

    def __call__(self, input_ids, scores, **kwargs):
        return torch.full((input_ids.shape[0],), input_ids.shape[1] >= self.length)


def test_max_time_and_stopping_criteria(byte_model):
    n = PROMPT.shape[1]
    sm = rewrite.apply(byte_model, "layerskip", exit_layer=2, num_speculations=4)
    criteria = StoppingCriteriaList([_StopAfter(n + 5)])
    out = sm.generate(PROMPT, max_new_tokens=20, eos_token_id=[], stopping_criteria=criteria)
    ref = byte_model.generate(PROMPT, attention_mask=torch.ones_like(PROMPT), max_new_tokens=20,
                              eos_token_id=None, stopping_criteria=criteria)  # fmt: skip
    assert out.shape[1] == n + 5 and out.tolist() == ref.tolist()
    out = sm.generate(PROMPT, max_new_tokens=20, eos_token_id=[], max_time=1e-9)
    assert out.shape[1] == n + 1  # the first token already runs past the time limit


class _RecordScores(StoppingCriteria):
    """Never stops; keeps the newest of the scores HF hands its stopping criteria (None when
    it hands none) at each sequence length."""

    def __init__(self) -> None:
        self.seen: dict[int, torch.Tensor | None] = {}

    def __call__(self, input_ids, scores, **kwargs):
        self.seen[input_ids.shape[1]] = None if scores is None else scores[-1].clone()
        return torch.zeros(input_ids.shape[0], dtype=torch.bool)


@pytest.mark.parametrize("keep_scores", [False, True])
def test_stopping_criteria_read_the_scores_hf_hands_them(keep_scores):
    # HF passes its criteria the processed scores so far under return_dict_in_generate with
    # output_scores, else None (a speculative round calls them once a round, leapfx once a
    # token: the last call per length is what both see).
    model = _model64(0)
    prompt = torch.tensor([[3, 9, 4, 3, 9]])
    kw = dict(max_new_tokens=6, repetition_penalty=1.4, eos_token_id=None)
    if keep_scores:
        kw.update(return_dict_in_generate=True, output_scores=True)
    ref = _RecordScores()
    model.generate(prompt, attention_mask=torch.ones_like(prompt), stopping_criteria=[ref], **kw)
    assert len(ref.seen) == 6
    for recipe in ("autoregressive", "lookup"):
        got = _RecordScores()
        rewrite.apply(model, recipe).generate(prompt, stopping_criteria=[got], **kw)
        assert got.seen.keys() == ref.seen.keys(), recipe
        for n, want in ref.seen.items():
            if want is None:
                assert got.seen[n] is None, recipe
            else:
                torch.testing.assert_close(got.seen[n], want, msg=recipe)


def test_return_dict_equals_hf_for_autoregressive():
    model = _model64(0)
    prompt = torch.tensor([[3, 9, 4, 3, 9]])
    kw = dict(max_new_tokens=9, return_dict_in_generate=True, output_scores=True,
              output_logits=True, repetition_penalty=1.4)  # fmt: skip
    ref = model.generate(prompt, attention_mask=torch.ones_like(prompt), **kw)
    out = rewrite.apply(model, "autoregressive").generate(prompt, **kw)
    assert type(out) is type(ref)
    assert torch.equal(out.sequences, ref.sequences)
    for ours, theirs in ((out.scores, ref.scores), (out.logits, ref.logits)):
        assert len(ours) == len(theirs)
        for a, b in zip(ours, theirs, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-9)
    assert out.metrics.new_tokens == 9
    plain = rewrite.apply(model, "autoregressive").generate(
        prompt, max_new_tokens=9, return_dict_in_generate=True
    )
    assert plain.scores is None and plain.logits is None


@pytest.mark.parametrize("recipe", [name for name, _ in LOSSLESS] + ["early_exit"])
def test_return_dict_shapes_for_every_recipe(recipe):
    model = _model64(1)
    options = dict(LOSSLESS).get(recipe, {"exit_layer": 2})
    sm = rewrite.apply(model, recipe, **options)
    prompt = torch.tensor([[3, 9, 4, 3, 9]])
    out = sm.generate(
        prompt,
        max_new_tokens=11,
        eos_token_id=[],
        return_dict_in_generate=True,
        output_scores=True,
        output_logits=True,
        no_repeat_ngram_size=2,
    )
    new = out.sequences.shape[1] - prompt.shape[1]
    assert new == 11 and len(out.scores) == new and len(out.logits) == new
    assert all(s.shape == (1, VOCAB) for s in out.scores + out.logits)
    # each emitted token is the argmax of its processed scores (greedy)
    assert [int(s.argmax()) for s in out.scores] == out.sequences[0, 5:].tolist()
    assert out.metrics is sm.last_metrics


def test_sampling_warpers_equal_hf_under_a_seed():
    """The autoregressive schedule draws as HF's ``_sample`` does (one multinomial per token
    from the processed distribution): under the same seed, the same tokens."""
    from transformers.generation import WatermarkingConfig

    model = _model64(2)
    prompt = torch.tensor([[3, 9, 4]])
    sm = rewrite.apply(model, "autoregressive")
    for extra in ({"min_p": 0.05}, {"top_h": 0.5}, {"typical_p": 0.8}, {"epsilon_cutoff": 3e-3},
                  {"eta_cutoff": 3e-3}, {"watermarking_config": WatermarkingConfig()},
                  {"repetition_penalty": 1.3, "top_k": 10, "temperature": 0.7}):  # fmt: skip
        kw = dict(do_sample=True, max_new_tokens=12, eos_token_id=[], **extra)
        torch.manual_seed(11)
        ref = model.generate(prompt, attention_mask=torch.ones_like(prompt), **kw)
        torch.manual_seed(11)
        assert sm.generate(prompt, **kw).tolist() == ref.tolist(), extra
    for recipe, options in LOSSLESS[1:]:  # sampling with processors runs in every schedule
        out = rewrite.apply(model, recipe, **options).generate(
            prompt, do_sample=True, max_new_tokens=10, min_p=0.05, no_repeat_ngram_size=2,
            generator=torch.Generator().manual_seed(0),
        )  # fmt: skip
        assert out.shape == (1, 13)


def _exact_processed_distribution(model, prompt, n: int, processors) -> dict:
    import itertools

    dist = {}
    base = prompt[0].tolist()
    for seq in itertools.product(range(model.config.vocab_size), repeat=n):
        p = 1.0
        for i in range(n):
            ids = torch.tensor([base + list(seq[:i])])
            with torch.no_grad():
                logits = model(ids).logits[:, -1].double()
            p *= float(torch.softmax(processors(ids, logits), dim=-1)[0, seq[i]])
            if p == 0.0:
                break
        dist[seq] = p
    return dist


def test_sampling_with_processors_has_the_target_distribution():
    """Rejection sampling against processed target rows (and processed draft q) samples what
    HF samples under the same processors: chi-square over the first three tokens."""
    from transformers.generation.logits_process import (
        LogitsProcessorList,
        NoRepeatNGramLogitsProcessor,
        RepetitionPenaltyLogitsProcessor,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
    )

    model = tiny_model("llama", layers=3, vocab=6, heads=2, kv_heads=1, seed=11)
    with torch.no_grad():
        model.lm_head.weight.mul_(0.25)  # a flatter target: more rejections
    prompt = torch.tensor([[1, 4, 2]])
    processors = LogitsProcessorList([
        RepetitionPenaltyLogitsProcessor(2.0), NoRepeatNGramLogitsProcessor(2),
        TemperatureLogitsWarper(0.9), TopKLogitsWarper(5),
    ])  # fmt: skip
    exact = _exact_processed_distribution(model, prompt, 3, processors)
    sm = rewrite.apply(model, "layerskip", exit_layer=1, num_speculations=4)
    n = 3000
    counts, rejections, _ = sample_counts(
        sm, prompt, exact, 3, n, temperature=0.9, top_k=5, top_p=1.0, repetition_penalty=2.0,
        no_repeat_ngram_size=2,
    )  # fmt: skip
    assert 0 < rejections
    assert_sampled_from(counts, exact, n)


def test_int32_prompts_with_processors(byte_model):
    sm = rewrite.apply(byte_model, "layerskip", exit_layer=2)
    kw = dict(max_new_tokens=10, repetition_penalty=1.3, no_repeat_ngram_size=2)
    assert torch.equal(sm.generate(PROMPT.int(), **kw).long(), sm.generate(PROMPT, **kw))
