"""``generate``'s arguments as HF reads them: the effective generation config, every field
honoured or refused, HF's processors and stopping criteria, and HF's output.

Both backends (``SpeculativeModel``, ``leapfx.lower.OnnxModel``) generate through one front end,
:class:`GenerateFrontEnd`: it calls :func:`prepare` with the model's generation config and
:func:`finish` with the tokens; only the stages (and where the defaults come from) differ.

The effective config is built as HF builds it (``GenerationMixin._prepare_generation_config``):
a copy of ``generation_config`` (or a fresh one), unset fields from the model's config, then
HF's global defaults, then ``**kwargs`` on top; the caller's objects are never written. Every
field of ``GenerationConfig`` is in exactly one of three tables (``tests/test_generate.py``
fails when transformers adds one that nobody classified):

- :data:`HONOURED`: applied as HF applies it (stop rules, sampling, every logits processor,
  outputs);
- :data:`NO_EFFECT`: fields that cannot change the tokens of batch-1 decoder-only decoding
  (HF ignores them there too, or they only tune HF's own cache and compilation);
- :data:`REFUSED`: a value other than the neutral one raises ``ValueError`` naming the field.
"""

from __future__ import annotations

import contextlib
import copy
import warnings
from dataclasses import dataclass, replace
from types import SimpleNamespace
from typing import Any

import torch
from transformers import GenerationConfig, LogitsProcessorList, StoppingCriteriaList
from transformers.generation.utils import GenerateDecoderOnlyOutput, GenerationMixin

from .decode import check_prompt, decode_request, left_padding, teacher_sequence, with_teacher
from .metrics import DecodeMetrics
from .processing import Processing
from .schedules import DecodeRequest

HONOURED = frozenset({
    "max_length", "max_new_tokens", "min_length", "min_new_tokens", "max_time", "stop_strings",
    "do_sample", "temperature", "top_k", "top_p", "min_p", "top_h", "typical_p",
    "epsilon_cutoff", "eta_cutoff", "repetition_penalty", "no_repeat_ngram_size",
    "bad_words_ids", "renormalize_logits", "forced_bos_token_id", "forced_eos_token_id",
    "remove_invalid_values", "exponential_decay_length_penalty", "suppress_tokens",
    "begin_suppress_tokens", "sequence_bias", "watermarking_config", "output_scores",
    "output_logits", "return_dict_in_generate", "pad_token_id", "bos_token_id", "eos_token_id",
})  # fmt: skip

# Field -> why it cannot change the tokens here.
NO_EFFECT = {
    "use_cache": "leapfx always decodes over its own static KV cache (same tokens)",
    "cache_implementation": "HF's cache class; leapfx runs its own static cache",
    "cache_config": "HF's cache options; leapfx runs its own static cache",
    "max_cache_len": "HF's static-cache size; leapfx sizes its cache per call",
    "compile_config": "HF's torch.compile options; use SpeculativeModel.compile()",
    "disable_compile": "HF's torch.compile switch; use SpeculativeModel.compile()",
    "prefill_chunk_size": "prefill in chunks gives the same tokens",
    "early_stopping": "beam search only (HF ignores it with num_beams=1)",
    "length_penalty": "beam search only (HF ignores it with num_beams=1)",
    "decoder_start_token_id": "encoder-decoder models only",
    "transformers_version": "metadata",
    "_from_model_config": "metadata",
}

# Field -> (its neutral value, what leapfx supports instead). Anything else is refused.
REFUSED: dict[str, tuple[Any, str]] = {
    "num_beams": (1, "1 (greedy decoding or sampling)"),
    "num_return_sequences": (1, "1 (call generate once per sequence)"),
    "num_beam_groups": (1, "1 (no group beam search)"),
    "diversity_penalty": (0.0, "0.0 (no group beam search)"),
    "penalty_alpha": (None, "None (no contrastive search)"),
    "low_memory": (None, "None (no contrastive search)"),
    "dola_layers": (None, "None (no DoLa decoding)"),
    "constraints": (None, "None (no constrained beam search)"),
    "force_words_ids": (None, "None (no constrained beam search)"),
    "guidance_scale": (None, "None or 1.0 (no classifier-free guidance)"),
    "token_healing": (None, "None or False"),
    "use_mtp": (None, "None or False (no multi-token prediction heads)"),
    "output_attentions": (False, "False (the stages return no attention maps)"),
    "output_hidden_states": (False, "False (use return_dict_in_generate for scores/logits)"),
    "encoder_repetition_penalty": (1.0, "1.0 (encoder-decoder models only)"),
    "encoder_no_repeat_ngram_size": (0, "0 (encoder-decoder models only)"),
    "is_assistant": (None, "None or False (leapfx is not an assistant model)"),
    "continuous_batching_config": (None, "None (batch size 1)"),
    "speculation_type": (None, "None (the recipe is the speculation: rewrite.apply)"),
    "assistant_early_exit": (None, "None (use the layerskip recipe)"),
    "prompt_lookup_num_tokens": (None, "None (HF's assisted decoding; use a leapfx recipe)"),
    "max_matching_ngram_size": (None, "None (HF's prompt lookup; use a leapfx recipe)"),
    "num_assistant_tokens": (20, "its default (HF's assisted decoding)"),
    "num_assistant_tokens_schedule": ("constant", "its default (HF's assisted decoding)"),
    "assistant_confidence_threshold": (0.4, "its default (HF's assisted decoding)"),
    "assistant_lookbehind": (10, "its default (HF's assisted decoding)"),
    "target_lookbehind": (10, "its default (HF's assisted decoding)"),
    "assistant_ensemble_weight": (None, "None (HF's assisted decoding)"),
}
# Values that count as neutral besides the one above (HF treats them the same).
_ALSO_NEUTRAL = {"guidance_scale": (1.0, 1), "token_healing": (False,), "use_mtp": (False,),
                 "is_assistant": (False,), "output_attentions": (None,),
                 "output_hidden_states": (None,)}  # fmt: skip

# generate()'s keyword arguments that are not generation-config fields.
CALL_ARGUMENTS = ("generator", "teacher_tokens", "tokenizer", "prefix_allowed_tokens_fn")
# HF generate() arguments leapfx refuses, with what to do instead.
REFUSED_ARGUMENTS = {
    "assistant_model": "use a leapfx recipe (rewrite.apply) for speculation",
    "assistant_tokenizer": "use a leapfx recipe (rewrite.apply) for speculation",
    "negative_prompt_ids": "classifier-free guidance is not supported",
    "negative_prompt_attention_mask": "classifier-free guidance is not supported",
    "synced_gpus": "leapfx decodes on one device",
    "inputs_embeds": "pass input_ids",
    "custom_generate": "leapfx runs its recipe's schedule",
    "past_key_values": "leapfx owns its KV cache",
}


class _Host:
    """What ``GenerationMixin``'s helpers read of a model: its generation config and a few
    config facts. One object for every backend, so an ONNX export builds the same lists."""

    def __init__(self, generation_config, vocab_size: int, max_positions: int | None) -> None:
        self.generation_config = generation_config
        self.config = SimpleNamespace(
            is_encoder_decoder=False,
            max_position_embeddings=max_positions,
            _get_generation_parameters=dict,  # nothing set on the model config (HF's legacy)
            get_text_config=lambda: SimpleNamespace(vocab_size=vocab_size),
        )

    @staticmethod
    def _merge_criteria_processor_list(default, custom):
        return GenerationMixin._merge_criteria_processor_list(None, default, custom)


@dataclass(frozen=True)
class Call:
    """One generate call: the effective config and the request a schedule runs."""

    config: Any  # the effective GenerationConfig (a copy)
    request: DecodeRequest
    # a batched (or left-padded) call's request a row: the call's, with HF's processors built
    # for the row (its padding and mask: HF's repetition penalty skips a row's left padding)
    # and the stopping criteria over the row's own sequence; None for one unpadded row
    rows: tuple[DecodeRequest, ...] | None = None


def effective_config(model_config, generation_config, kwargs: dict[str, Any]):
    """HF's effective ``GenerationConfig`` for a call, and the leftover kwargs (not fields)."""

    if generation_config is not None and not isinstance(generation_config, GenerationConfig):
        raise ValueError(
            f"generation_config: {type(generation_config).__name__} is invalid; allowed: a "
            "transformers.GenerationConfig or None"
        )
    host = _Host(model_config or GenerationConfig(), 0, None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # HF's deprecation notes about mixing both
        config, rest = GenerationMixin._prepare_generation_config(host, generation_config, **kwargs)
    rest.pop("output_attentions", None)  # HF keeps these for forward(); refused below
    rest.pop("output_hidden_states", None)
    return config, rest


def check_fields(config) -> None:
    """ValueError naming a field of ``config`` that leapfx cannot honour, and what it allows."""
    for name, (neutral, allowed) in REFUSED.items():
        value = getattr(config, name, None)
        if value is None or value == neutral or value in _ALSO_NEUTRAL.get(name, ()):
            continue
        raise ValueError(f"{name}: {value!r} is not supported by leapfx; allowed: {allowed}")


def prepare(
    *,
    input_ids: torch.Tensor,
    prompt: torch.Tensor,
    model_config,
    vocab_size: int,
    max_positions: int | None,
    generation_config,
    logits_processor,
    stopping_criteria,
    streamer,
    kwargs: dict[str, Any],
    recipe: str,
    lossless: bool,
    attention_mask: torch.Tensor | None = None,
) -> Call:
    """Check a call's arguments and build its effective config and DecodeRequest.

    ``prompt`` is ``input_ids`` on the decode's device; ``model_config`` the model's (or the
    export's) generation config; ``attention_mask`` the call's (checked), for a batch.
    """

    logits_processor = LogitsProcessorList(logits_processor or [])
    stopping_criteria = StoppingCriteriaList(stopping_criteria or [])
    kwargs = dict(kwargs)
    own = {name: kwargs.pop(name, None) for name in CALL_ARGUMENTS}
    for name in kwargs:
        if name in REFUSED_ARGUMENTS:
            raise ValueError(f"{name}: not supported by leapfx; {REFUSED_ARGUMENTS[name]}")
    teacher = teacher_sequence(own["teacher_tokens"], recipe, lossless)
    if teacher is not None and "max_new_tokens" not in kwargs and "max_length" not in kwargs:
        kwargs["max_new_tokens"] = len(teacher)  # teacher forcing: as many as the teacher's
    max_new = kwargs.get("max_new_tokens")
    if max_new is not None and (not isinstance(max_new, int) or max_new < 1):
        raise ValueError(f"max_new_tokens: {max_new!r} is invalid; allowed: int >= 1")
    config, rest = effective_config(model_config, generation_config, kwargs)
    if rest:
        name = next(iter(rest))
        raise ValueError(
            f"{name}: unknown argument to generate; allowed: GenerationConfig fields, "
            f"attention_mask, generation_config, logits_processor, stopping_criteria, "
            f"streamer, {', '.join(CALL_ARGUMENTS)}"
        )
    check_fields(config)
    n = prompt.shape[1]
    if config.max_new_tokens is None:
        config.max_new_tokens = config.max_length - n
        if config.max_new_tokens < 1:
            raise ValueError(
                f"max_length: {config.max_length} leaves no room after the {n}-token prompt; "
                "allowed: max_length > the prompt length, or pass max_new_tokens"
            )
    if isinstance(config.max_new_tokens, int):
        config.max_length = n + config.max_new_tokens  # as HF's _prepare_generated_length
    if config.min_new_tokens is not None:  # HF: min_new_tokens (even 0) overrides min_length
        config.min_length = n + config.min_new_tokens
    if config.eos_token_id == []:  # no EOS: HF's tensor of it would be empty
        config.eos_token_id = None
        # HF's length penalty raises the logits of an empty EOS set: it changes nothing
        config.exponential_decay_length_penalty = None
    if config.exponential_decay_length_penalty is not None and config.eos_token_id is None:
        # HF's processor raises a bare RuntimeError here: it raises the EOS logit, so needs one
        raise ValueError(
            "exponential_decay_length_penalty: needs an EOS token to favour; allowed: with "
            "eos_token_id set (in the call or the model's generation_config)"
        )
    config.validate()
    host = _Host(config, vocab_size, max_positions)
    GenerationMixin._prepare_special_tokens(host, config, True, device=prompt.device)
    stopping = _stopping(host, config, stopping_criteria, own["tokenizer"])
    record = bool(config.return_dict_in_generate and (config.output_scores or config.output_logits))
    request = decode_request(
        config, n, max_new_tokens=config.max_new_tokens, eos_token_id=config.eos_token_id,
        sampling={}, generator=own["generator"], streamer=streamer,
    )  # fmt: skip
    criteria_scores = bool(config.return_dict_in_generate and config.output_scores)
    mask = torch.ones_like(prompt) if attention_mask is None else attention_mask.to(prompt.device)

    def processing_of(ids: torch.Tensor, row_mask: torch.Tensor) -> Processing:
        processors = GenerationMixin._get_logits_processor(
            host, config, input_ids_seq_length=n, prefix_allowed_tokens_fn=own[
                "prefix_allowed_tokens_fn"], logits_processor=logits_processor,
            device=prompt.device, model_kwargs={"attention_mask": row_mask},
        )  # fmt: skip
        return Processing(ids, processors, stopping, record=record, criteria_scores=criteria_scores)

    def with_processing(processing: Processing) -> DecodeRequest:
        if processing.active or processing.stopping or record:
            return replace(request, processing=processing)
        return request

    rows = None
    if prompt.shape[0] > 1 or not bool(mask.all()):
        rows = tuple(
            with_processing(processing_of(prompt[b : b + 1], mask[b : b + 1]))
            for b in range(prompt.shape[0])
        )
        request = replace(request, processing=rows[0].processing)  # what the checks read
    else:
        request = with_processing(processing_of(prompt, mask))
    return Call(config, with_teacher(request, teacher), rows)


def _stopping(host: _Host, config, stopping_criteria, tokenizer):
    """HF's stopping criteria except those leapfx checks natively (max length, EOS)."""
    native = copy.copy(config)
    native.max_length, native._eos_token_tensor = None, None
    return GenerationMixin._get_stopping_criteria(host, native, stopping_criteria, tokenizer)


def finish(input_ids: torch.Tensor, tokens: list[int], call: Call, metrics: DecodeMetrics) -> Any:
    """``generate``'s return: [1, prompt + new] ids, or HF's ``GenerateDecoderOnlyOutput``
    (``sequences``; ``scores``/``logits`` when asked; ``metrics``) with return_dict_in_generate.
    """
    new = torch.tensor([tokens], dtype=input_ids.dtype, device=input_ids.device)
    sequences = torch.cat([input_ids, new], dim=1)
    config = call.config
    if not config.return_dict_in_generate:
        return sequences

    processing = call.request.processing
    scores = logits = None
    if config.output_scores:
        # processed already, token by token, where stopping criteria read them
        kept = processing.stopping and processing.criteria_scores
        scores = tuple(processing.processed) if kept else processing.replay(input_ids.shape[1])
    if config.output_logits:
        logits = tuple(processing.logits)
    out = GenerateDecoderOnlyOutput(sequences=sequences, scores=scores, logits=logits)
    out.metrics = metrics
    return out


def check_batch_call(call: Call, rows: int) -> None:
    """Refuse what a batched decode does not honour, naming it: recorded scores, a streamer
    for more than one row (HF's streamers take one row), teacher forcing. Logits processors
    and stopping criteria apply a row at a time (``Call.rows``)."""
    request = call.request
    where = f"with a batch ({rows} rows, or a left-padded row)"
    if request.streamer is not None and rows > 1:
        raise ValueError(
            f"streamer: not supported with a batch of {rows} rows (HF's streamers take one "
            "row); allowed: streamer=None, or one (left-padded) row"
        )
    if request.teacher_tokens is not None:
        raise ValueError(f"teacher_tokens: not supported {where}; allowed: one unpadded row")
    processing = request.processing
    if processing is not None and processing.record:
        raise ValueError(
            f"output_scores/output_logits: not supported {where}; allowed: False (sequences "
            "and metrics only)"
        )
    if processing is not None and processing.stopping and not request.eos_token_ids and rows > 1:
        names = ", ".join(type(c).__name__ for c in processing.stopping)
        raise ValueError(
            f"stopping_criteria ({names}) with a batch of {rows} rows and no EOS token: HF's "
            "generate decodes a stopped row on to the longest row's end then; allowed: "
            "eos_token_id set (a stopped row is then filled with the pad token, as HF does)"
        )


def finish_batch(
    input_ids: torch.Tensor, rows: list[list[int]], call: Call, metrics: DecodeMetrics
) -> Any:
    """A batched ``generate``'s return, as HF's: [B, S + T] ids (T: the longest row's new
    tokens; a row that stopped sooner is filled with the pad token), or HF's
    ``GenerateDecoderOnlyOutput`` (``sequences``, ``metrics``) with return_dict_in_generate."""
    longest = max(len(r) for r in rows)
    pad = getattr(call.config, "_pad_token_tensor", None)
    pad = int(pad.reshape(-1)[0]) if isinstance(pad, torch.Tensor) else call.config.pad_token_id
    if pad is None:
        pad = 0  # only rows of equal length get here: nothing stops a row early without EOS
    new = torch.full((len(rows), longest), pad, dtype=input_ids.dtype, device=input_ids.device)
    for b, r in enumerate(rows):
        new[b, : len(r)] = torch.tensor(r, dtype=input_ids.dtype)
    sequences = torch.cat([input_ids, new], dim=1)
    if not call.config.return_dict_in_generate:
        return sequences
    from transformers.generation.utils import GenerateDecoderOnlyOutput

    out = GenerateDecoderOnlyOutput(sequences=sequences)
    out.metrics = metrics
    return out


@dataclass(frozen=True)
class GenerationSource:
    """Where a model's ``generate`` takes its defaults and limits from."""

    config: Any  # the model's (or the export's) GenerationConfig
    vocab_size: int
    max_positions: int | None  # the positions the rotary tables cover (None: unknown)
    recipe: str  # the recipe whose schedule decodes (named in errors and metrics)
    lossless: bool


class GenerateFrontEnd:
    """HF's ``generate`` over a recipe's schedule: the one front end of ``SpeculativeModel`` and
    ``OnnxModel``. A model says where its defaults come from (``_generation_source``), puts the
    prompt where its stages run (``_generate_prompt``) and decodes (``_generate_decode``)."""

    last_metrics: DecodeMetrics | None
    # True: the whole call runs under torch.inference_mode (its output an inference tensor);
    # False: only what ``_generate_decode`` puts under it.
    _generate_in_inference_mode: bool = True

    def generate(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        generation_config: Any | None = None,
        logits_processor: Any | None = None,
        stopping_criteria: Any | None = None,
        streamer: Any | None = None,
        **kwargs: Any,
    ) -> Any:
        """Generate like HF ``generate``: returns [1, prompt + new] token ids.

        The signature and its meaning are HF's: ``generation_config`` (default: the model's; an
        ``OnnxModel``'s: the exported model's, saved in its manifest)
        with ``**kwargs`` overriding its fields (``max_new_tokens``, ``max_length``,
        ``min_new_tokens``, ``do_sample``, ``temperature``, ``top_k``, ``top_p``,
        ``repetition_penalty``, ``no_repeat_ngram_size``, ``eos_token_id`` (an int or a list),
        ``stop_strings`` with ``tokenizer=``, ...); the caller's config is never written.
        HF's logits processors (and ``logits_processor``) apply inside speculation at every
        verified position, so a lossless recipe emits what HF's ``generate`` emits under the
        same config; ``stopping_criteria`` join HF's. ``return_dict_in_generate=True`` returns
        HF's ``GenerateDecoderOnlyOutput`` (``sequences``, ``scores``/``logits`` with
        ``output_scores``/``output_logits``, and ``metrics``). A field leapfx cannot honour
        (``num_beams`` > 1, ``output_attentions`` ...) or an unknown argument raises
        ``ValueError`` naming it (``leapfx.runtime.generation`` lists every field).

        leapfx's own arguments: ``generator`` (a ``torch.Generator`` for reproducible
        sampling); ``teacher_tokens`` (lossy recipes): the full model's greedy continuation of
        the prompt, [m] or [1, m]; the recipe emits these tokens instead of its own and
        ``last_metrics.agreement`` is the share of positions where its own choice (exit
        decisions made on its own cache state) was the same token. ``max_new_tokens`` defaults
        to m and may not exceed it. ``streamer``: HF's streamer protocol (``put``/``end``, e.g.
        ``transformers.TextIteratorStreamer``): the prompt, then each group of new tokens as the
        schedule emits it (a round's accepted drafts at once), then ``end()``.

        Greedy output is token-identical to ``hf_model.generate(input_ids, do_sample=False)``
        for lossless recipes; with ``do_sample=True`` it has the same distribution as HF
        sampling with the same config. Metrics land in ``self.last_metrics``. Exactly so in
        float32 and float64; in bfloat16/float16 or on a GPU a verify pass over several
        positions rounds differently from one-token steps and may resolve a near tie between
        the top two logits the other way (``leapfx.bench.ties`` measures it; see docs/gpu.md).
        """
        mode = self._generate_in_inference_mode
        with torch.inference_mode() if mode else contextlib.nullcontext():
            source = self._generation_source()
            check_prompt(input_ids, attention_mask, source.vocab_size)
            pads = left_padding(attention_mask) or [0] * input_ids.shape[0]
            prompt = self._generate_prompt(input_ids)
            call = prepare(
                input_ids=input_ids, prompt=prompt, model_config=source.config,
                vocab_size=source.vocab_size, max_positions=source.max_positions,
                generation_config=generation_config, logits_processor=logits_processor,
                stopping_criteria=stopping_criteria, streamer=streamer, kwargs=kwargs,
                recipe=source.recipe, lossless=source.lossless, attention_mask=attention_mask,
            )  # fmt: skip
            if input_ids.shape[0] > 1 or any(pads):
                check_batch_call(call, input_ids.shape[0])
                requests = list(call.rows)
                rows, self.last_metrics = self._generate_batch(prompt, pads, requests)
                return finish_batch(input_ids, rows, call, self.last_metrics)
            tokens, self.last_metrics = self._generate_decode(prompt, call.request)
            return finish(input_ids, tokens, call, self.last_metrics)

    def _generate_batch(
        self, prompt: torch.Tensor, pads: list[int], requests: list[DecodeRequest]
    ) -> tuple[list[list[int]], DecodeMetrics]:
        """Each row's new tokens of a batched (or left-padded) ``prompt`` [B, S] and the
        decode's metrics; ``pads``: each row's left pad tokens; ``requests``: each row's."""
        raise ValueError(
            f"input_ids: {prompt.shape[0]} rows (or a left-padded row) are not supported on the "
            f"onnxruntime backend ({type(self).__name__}: its exported stages and cache take one "
            "row); allowed: one unpadded row, or a SpeculativeModel on the eager backend"
        )

    def _generation_source(self) -> GenerationSource:
        raise NotImplementedError

    def _generate_prompt(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``input_ids`` where the stages run (checked already)."""
        raise NotImplementedError

    def _generate_decode(
        self, prompt: torch.Tensor, request: DecodeRequest
    ) -> tuple[list[int], DecodeMetrics]:
        """The new tokens of ``request`` after ``prompt`` and the decode's metrics (called by
        ``generate``: a warning about the caller's call takes ``stacklevel=3``)."""
        raise NotImplementedError
