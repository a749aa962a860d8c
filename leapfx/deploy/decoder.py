"""``Decoder``: a leapfx ONNX export decoded with onnxruntime, numpy and tokenizers alone.

``leapfx.lower.onnxruntime.OnnxModel`` runs an export under the recipe's own torch schedule
(``leapfx.runtime``), which is what tests compare with the eager stages; a deployment has no
torch. This module runs the same exports without it: the stages as onnxruntime sessions over
zero-filled numpy cache buffers (bound as both ``past`` and ``present``, so a call writes its
positions in place), and the greedy schedules of the exportable recipes written over numpy:

- ``autoregressive``: ``full`` on the prompt, then one ``full`` call a token;
- ``early_exit``: the same over ``draft`` (layers < E and the exit head; lossy);
- ``layerskip`` / ``kangaroo``: rounds of up to d drafts from ``draft`` (``draft_chain``: the d
  greedy steps of a fixed-length round in one call), Kangaroo stopping after the first draft
  whose top probability is <= its threshold, then one ``verify`` call (the lower layers on the
  last draft, the upper layers on the round's exit states and it); the accepted prefix is
  kept by moving a position, nothing is copied. ``lookup=True`` tries prompt lookup first
  each round, verified by ``full``;
- ``swift``: rounds of d drafts from ``draft`` (the model without its skip set, which writes
  the kept layers' keys), then one ``full`` call over [x, drafts], which writes every
  layer's keys for those positions; ``lookup=True`` tries prompt lookup first;
- ``eagle``: ``target`` on the prompt (every layer, and the head's cache slot from the true
  features, fed h of the position before: zeros at 0), then rounds of up to d drafts from
  ``head`` on (token, state), the first state h of the last accepted position and then the
  head's own, stopping after the first draft whose top probability is <= its threshold, and
  one ``target`` call over [x, drafts], which writes the head's slot again from the true
  features (the drafts' head keys are past the accepted positions then, so moving the
  position drops them); ``lookup=True`` tries prompt lookup first each round, verified by
  ``target``;
- ``m2r2``: rounds of up to d drafts from ``draft`` (M2R2's fast stream: it reads the slow
  keys of the verified positions and writes no cache slot), the round's scratch passed from
  draft to draft as arrays (the first draft's ``fast_past.{i}.*`` of length 0, each later's
  the ``fast_present.{i}.*`` the one before returned, with ``fast_keys`` the slow slots the
  round's first draft chose), stopping after the first draft whose
  top probability is <= its threshold, then one ``full`` call over [x, drafts];
  ``lookup=True`` tries prompt lookup first each round;
- ``lookup`` / ``auto``: prompt lookup (the longest suffix of ``max_ngram`` .. ``min_ngram``
  tokens found earlier in the text drafts what followed it), verified by ``full``. ``auto``'s
  adaptive choice of the draft length is a speed policy measured on torch timings; here it
  drafts as ``lookup`` does (greedy verification keeps the tokens the same).

Greedy only: every lossless recipe then gives HF greedy's tokens, and the lossy ones
(``early_exit``) the eager stages' (``tests/test_deploy.py`` runs each with torch blocked from
import). One sequence a call (the exported stages write the first row's positions). Text in and
out through the export's ``tokenizer.json`` (``tokenizers``), when the export has one.

    >>> from leapfx.deploy import Decoder
    >>> model = Decoder("layerskip-onnx/")
    >>> model.generate([1, 5, 9], max_new_tokens=32)     # token ids in, new token ids out
    >>> model.generate_text("def fib(n):", max_new_tokens=32)
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from .manifest import GENAI_FORMAT, MANIFEST, read_manifest

# The schedules of this module, by the recipe the manifest names.
SCHEDULES = (
    "autoregressive", "early_exit", "layerskip", "kangaroo", "swift", "eagle", "m2r2", "lookup",
    "auto",
)  # fmt: skip
_DTYPES = {"float32": np.float32, "float16": np.float16}
_LOOKUP = {"num_speculations": 10, "max_ngram": 3, "min_ngram": 1}  # leapfx's lookup defaults


class Cache:
    """Zero-filled key/value buffers ``[1, H_kv, max_len, D]`` per cache slot, as OrtValues
    over numpy memory (a masked slot must hold finite numbers)."""

    def __init__(self, shapes: Sequence[tuple[int, int]], max_len: int, dtype: Any) -> None:
        import onnxruntime as ort

        self.max_len = max_len
        self.arrays = [
            [np.zeros((1, h, max_len, d), dtype=dtype) for _ in range(2)] for h, d in shapes
        ]
        self.values = [[ort.OrtValue.ortvalue_from_numpy(a) for a in kv] for kv in self.arrays]


class Stage:
    """One exported stage: a session whose cache inputs and outputs are bound to the slots'
    buffers (a ``draft_chain``'s every step's presents too)."""

    def __init__(self, session, spec: dict[str, Any]) -> None:
        self.session = session
        self.slots: list[int] = list(spec["cache_reads"])
        # the slots whose present is bound too (M2R2's draft reads slow slots it does not write)
        self.writes = set(spec.get("cache_writes", self.slots))
        self.inputs = [n for n in spec["inputs"] if not n.startswith("past_key_values.")]
        self.outputs = [n for n in spec["outputs"] if not n.startswith("present.")]
        self.chain = int(spec["chain"]["length"]) if "chain" in spec else 0
        self._io = None
        self._cache: Cache | None = None

    def __call__(self, cache: Cache, **feeds: np.ndarray) -> dict[str, np.ndarray]:
        if cache is not self._cache:
            io = self.session.io_binding()
            for slot in self.slots:
                for kind, value in zip(("key", "value"), cache.values[slot], strict=True):
                    io.bind_ortvalue_input(f"past_key_values.{slot}.{kind}", value)
                    if slot not in self.writes:
                        continue
                    present = f"present.{slot}.{kind}"
                    for step in range(max(self.chain - 1, 0)):
                        io.bind_ortvalue_output(f"{present}.step{step}", value)
                    io.bind_ortvalue_output(present, value)
            self._io, self._cache = io, cache
        io = self._io
        arrays = [np.ascontiguousarray(feeds[name]) for name in self.inputs]
        for name, array in zip(self.inputs, arrays, strict=True):
            io.bind_cpu_input(name, array)
        for name in self.outputs:
            io.bind_output(name, "cpu")
        self.session.run_with_iobinding(io)
        values = io.get_outputs()[-len(self.outputs) :]  # the presents were bound first
        return {name: v.numpy() for name, v in zip(self.outputs, values, strict=True)}


def _positions(start: int, n: int) -> np.ndarray:
    return np.arange(start, start + n, dtype=np.int64)[None, :]  # [1, n]


def _ids(tokens: Sequence[int]) -> np.ndarray:
    return np.asarray(tokens, dtype=np.int64)[None, :]  # [1, n]


def _argmax(logits: np.ndarray) -> int:
    return int(np.argmax(logits))  # the first of equal maxima, as torch.argmax


def _top_probability(logits: np.ndarray) -> float:
    z = logits.astype(np.float64) - logits.max()
    return float(1.0 / np.exp(z).sum())  # softmax at the argmax


def lookup_drafts(context: Sequence[int], d: int, max_ngram: int, min_ngram: int) -> list[int]:
    """Prompt lookup: for n from ``max_ngram`` down to ``min_ngram``, the latest earlier match
    of the context's last n tokens; the up to ``d`` tokens that followed it (none: [])."""
    for n in range(min(max_ngram, len(context) - 1), min_ngram - 1, -1):
        suffix = list(context[-n:])
        for start in range(len(context) - n - 1, -1, -1):
            if list(context[start : start + n]) == suffix:
                return list(context[start + n : start + n + d])
    return []


class Decoder:
    """A leapfx ONNX export (``export_onnx(..., format="leapfx")``, or a ``format="genai"``
    folder) decoded greedily with onnxruntime and numpy (see the module docstring).

    Args:
        path: the export directory.
        threads: onnxruntime intra-op threads per session (None: onnxruntime's choice).
        providers: onnxruntime execution providers (None: CPU).
        recipe: whose schedule to run; None: the exported recipe's. ``"autoregressive"`` and
            ``"lookup"`` run on any export with a ``full`` stage, ``"early_exit"`` on one with
            ``draft``.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        threads: int | None = None,
        providers: Sequence[str] | None = None,
        recipe: str | None = None,
    ) -> None:
        import onnxruntime as ort

        self.path = Path(path)
        if threads is not None and (not isinstance(threads, int) or threads < 1):
            raise ValueError(f"threads: {threads!r} is invalid; allowed: an integer >= 1 or None")
        options = ort.SessionOptions()
        if threads is not None:
            options.intra_op_num_threads = threads
            options.inter_op_num_threads = 1
        chosen = list(providers) if providers is not None else ["CPUExecutionProvider"]
        self.genai = _is_genai(self.path)
        if self.genai:
            self.manifest = json.loads((self.path / MANIFEST).read_text())
            config = json.loads((self.path / "genai_config.json").read_text())["model"]
            self.recipe = "autoregressive"
            if recipe not in (None, "autoregressive"):
                raise ValueError(
                    f"recipe: {recipe!r} cannot run on a standard decoder export; allowed: "
                    "None, 'autoregressive'"
                )
            file = self.path / config["decoder"]["filename"]
            self._decoder = ort.InferenceSession(str(file), options, providers=chosen)
            self.options: dict[str, Any] = {}
            eos = config["eos_token_id"]
            self.eos = frozenset([eos] if isinstance(eos, int) else eos)
            self._genai = config
        else:
            self.manifest = read_manifest(self.path)
            m = self.manifest
            self.recipe = m["recipe"] if recipe is None else recipe
            self._check_recipe(m)
            self.stages = {}
            for name, spec in m["stages"].items():
                if "chain" in spec and self.recipe != m["recipe"]:
                    continue
                session = ort.InferenceSession(
                    str(self.path / spec["file"]), options, providers=chosen
                )
                self.stages[name] = Stage(session, spec)
            self.options = dict(m["options"])
            self.eos = frozenset(_eos(m))
            self._shapes = list(
                zip(m["cache"]["num_kv_heads"], m["cache"]["head_dim"], strict=True)
            )
            self._dtype = _DTYPES[m["dtype"]]
            self._limit = m["attention"].get("rotary_positions")
        self._cache: Cache | None = None
        tokenizer = self.path / "tokenizer.json"
        self.tokenizer = None
        if tokenizer.is_file():
            from tokenizers import Tokenizer

            self.tokenizer = Tokenizer.from_file(str(tokenizer))
        self.last_stats: dict[str, int] = {}

    def _check_recipe(self, m: dict[str, Any]) -> None:
        needs = {"autoregressive": "full", "lookup": "full", "auto": "full", "early_exit": "draft"}
        if self.recipe not in SCHEDULES:
            raise ValueError(
                f"recipe: {self.recipe!r} has no torch-free schedule; allowed: "
                f"{', '.join(SCHEDULES)} (others: leapfx.export.OnnxModel, which needs torch)"
            )
        # a baseline runs a stage on token runs: not M2R2's draft, which takes a scratch
        runs = {n for n, spec in m["stages"].items() if "scratch" not in spec}
        if self.recipe != m["recipe"] and needs.get(self.recipe) not in runs:
            allowed = [m["recipe"], *(r for r, s in needs.items() if s in runs)]
            raise ValueError(
                f"recipe: {self.recipe!r} cannot run on this {m['recipe']} export; allowed: "
                f"{', '.join(allowed)}"
            )
        if m["options"].get("draft_vocab") is not None:
            raise ValueError(
                "recipe: a draft_vocab head maps its drafts through a table this runtime does "
                "not read; allowed: exports without draft_vocab (or OnnxModel)"
            )

    # -- token ids in, token ids out ------------------------------------------------------

    def generate(self, prompt: Sequence[int], max_new_tokens: int = 32) -> list[int]:
        """Greedy decoding of ``prompt`` (token ids); returns the new tokens, the first EOS
        included."""
        prompt = [int(t) for t in prompt]
        if not prompt:
            raise ValueError("prompt: it is empty; allowed: one or more token ids")
        if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens: {max_new_tokens!r} is invalid; allowed: >= 1")
        self.last_stats = {"full_calls": 0, "draft_calls": 0, "verify_calls": 0, "accepted": 0}
        if self.genai:
            return self._genai_decode(prompt, max_new_tokens)
        d = int(self.options.get("num_speculations") or self.options.get("max_draft_tokens") or 0)
        needed = len(prompt) + max_new_tokens + d + 1
        if self._limit is not None and needed > self._limit:
            raise ValueError(
                f"max_new_tokens: the prompt plus max_new_tokens need {needed} positions but "
                f"the export's rotary tables cover {self._limit}; shorten either"
            )
        if self._cache is None or self._cache.max_len < needed:
            self._cache = Cache(self._shapes, needed, self._dtype)
        return self._decode(prompt, max_new_tokens)

    def _call(
        self, name: str, key: str | None = None, **feeds: np.ndarray
    ) -> dict[str, np.ndarray]:
        """Stage ``name`` on ``feeds``, counted in ``last_stats`` under ``key`` (default: by
        the stage's name)."""
        if key is None:
            key = {"full": "full_calls", "verify": "verify_calls"}.get(name, "draft_calls")
        self.last_stats[key] += 1
        return self.stages[name](self._cache, **feeds)

    def _step(
        self, stage: str, tokens: Sequence[int], start: int, key: str | None = None
    ) -> np.ndarray:
        """Logits [n, V] of ``tokens`` at positions start.. through ``stage`` (counted under
        ``key``)."""
        positions = _positions(start, len(tokens))
        return self._call(stage, key, input_ids=_ids(tokens), position_ids=positions)["logits"][0]

    def _target(self, tokens: Sequence[int], start: int, key: str) -> np.ndarray:
        """EAGLE's ``target`` on ``tokens`` at start.., fed h of the position before
        (``self._h``); keeps the hidden states [1, n, D] of the call (``self._states``) and
        returns the logits [n, V]."""
        out = self._call(
            "target", key, input_ids=_ids(tokens), position_ids=_positions(start, len(tokens)),
            prev_hidden=self._h,
        )  # fmt: skip
        self._states = out["hidden"]
        return out["logits"][0]

    def _eagle_drafts(self, x: int, pos: int, d: int) -> list[int]:
        """Up to d drafts of EAGLE's head from token x at ``pos``, reading h of the position
        before (then its own state g), stopping after the first whose top probability is <=
        the threshold."""
        threshold = float(self.options.get("confidence_threshold") or 0.0)
        drafts: list[int] = []
        token, state = x, self._h
        for i in range(d):
            out = self._call(
                "head", input_ids=_ids([token]), position_ids=_positions(pos + i, 1),
                hidden_in=state,
            )  # fmt: skip
            row, state = out["logits"][0, -1], out["hidden"]
            token = _argmax(row)
            drafts.append(token)
            if threshold > 0 and i + 1 < d and _top_probability(row) <= threshold:
                break
        return drafts

    def _fast_drafts(self, x: int, pos: int, d: int) -> list[int]:
        """Up to d drafts of M2R2's fast stream from token x at ``pos``, the round's scratch
        passed from draft to draft (zero-length before the first), stopping after the first
        whose top probability is <= the threshold."""
        threshold = float(self.options.get("confidence_threshold") or 0.0)
        spec = self.manifest["stages"]["draft"]["scratch"]
        # zeros as the manifest says (keys and values of length 0: no earlier draft yet)
        scratch = {
            name: np.zeros((1, *f["shape"]), dtype=np.dtype(f["dtype"]))
            for name, f in spec["first"].items()
        }
        drafts: list[int] = []
        token = x
        for i in range(d):
            out = self._call(
                "draft", input_ids=_ids([token]), position_ids=_positions(pos + i, 1), **scratch
            )
            scratch = {n: out[o] for n, o in zip(spec["inputs"], spec["outputs"], strict=True)}
            row = out["logits"][0, -1]
            token = _argmax(row)
            drafts.append(token)
            if threshold > 0 and i + 1 < d and _top_probability(row) <= threshold:
                break
        return drafts

    def _decode(self, prompt: list[int], budget: int) -> list[int]:
        recipe = self.recipe
        eagle = recipe == "eagle"
        stage = "draft" if recipe == "early_exit" else "full"
        if eagle:  # h before the prompt: zeros
            self._h = np.zeros((1, 1, self.manifest["hidden_size"]), dtype=self._dtype)
            logits = self._target(prompt, 0, "full_calls")
            self._h = self._states[:, -1:]
        else:
            logits = self._step(stage, prompt, 0)
        out: list[int] = []
        x = _argmax(logits[-1])
        pos = len(prompt)  # x's position, not yet in the cache
        if not self._emit(out, [x], budget):
            return out
        o = self.options
        speculative = recipe in ("layerskip", "kangaroo", "swift", "eagle", "m2r2")
        lookup = recipe in ("lookup", "auto") or (speculative and o.get("lookup"))
        d_max = int(o.get("max_draft_tokens") or o.get("num_speculations") or 0)
        if recipe in ("lookup", "auto"):
            d_max = int(o.get("num_speculations", _LOOKUP["num_speculations"]))
        while True:
            d = min(d_max, budget - len(out) - 1) if speculative or lookup else 0
            drafts: list[int] = []
            if lookup and d > 0:
                drafts = lookup_drafts(
                    prompt + out, d, int(o.get("max_ngram", _LOOKUP["max_ngram"])),
                    int(o.get("min_ngram", _LOOKUP["min_ngram"])),
                )  # fmt: skip
            if eagle:  # lookup's drafts or the head's, verified by target over [x, drafts]
                drafts = drafts or (self._eagle_drafts(x, pos, d) if d > 0 else [])
                key = "verify_calls" if drafts else "full_calls"
                targets = self._target([x, *drafts], pos, key)
            elif drafts:  # verified by the full stage over [x, drafts]
                targets = self._step("full", [x, *drafts], pos)
            elif recipe == "m2r2" and d > 0:  # the fast stream's drafts, verified by full
                drafts = self._fast_drafts(x, pos, d)
                targets = self._step("full", [x, *drafts], pos, "verify_calls")
            elif recipe == "swift" and d > 0:  # the layer-skipped drafts, verified by full
                token = x
                for i in range(d):
                    token = _argmax(self._step("draft", [token], pos + i)[-1])
                    drafts.append(token)
                targets = self._step("full", [x, *drafts], pos, "verify_calls")
            elif speculative and d > 0:
                drafts, targets = self._exit_round(x, pos, d)
            else:
                x = _argmax(self._step(stage, [x], pos)[-1])
                pos += 1
                if not self._emit(out, [x], budget):
                    return out
                continue
            k = 0
            while k < len(drafts) and drafts[k] == _argmax(targets[k]):
                k += 1
            self.last_stats["accepted"] += k
            x = _argmax(targets[k])
            if eagle:
                self._h = self._states[:, k : k + 1]  # h of the last kept position
            pos += k + 1  # x and the k accepted drafts; later slots are masked, never read
            if not self._emit(out, [*drafts[:k], x], budget):
                return out

    def _exit_round(self, x: int, pos: int, d: int) -> tuple[list[int], np.ndarray]:
        """Drafts from the exit (up to d; Kangaroo stops early) and verify's target logits
        [len(drafts) + 1, V] over [x, drafts]."""
        threshold = float(self.options.get("confidence_threshold") or 0.0)
        chain = self.stages.get("draft_chain")
        if threshold <= 0 and chain is not None and chain.chain == d:
            out = self._call("draft_chain", input_ids=_ids([x]), position_ids=_positions(pos, 1))
            drafts = [int(t) for t in out["tokens"][0]]
            hidden = out["hidden"]  # [1, d, H]
        else:
            drafts, states = [], []
            token = x
            for i in range(d):
                out = self._call(
                    "draft", input_ids=_ids([token]), position_ids=_positions(pos + i, 1)
                )
                row = out["logits"][0, -1]
                token = _argmax(row)
                drafts.append(token)
                states.append(out["hidden"])
                if threshold > 0 and i + 1 < d and _top_probability(row) <= threshold:
                    break
            hidden = np.concatenate(states, axis=1)
        n = len(drafts)
        targets = self._call(
            "verify",
            input_ids=_ids(drafts[-1:]),
            position_ids=_positions(pos + n, 1),
            exit_hidden=hidden,
            remainder_position_ids=_positions(pos, n + 1),
        )["logits"][0]
        return drafts, targets

    def _emit(self, out: list[int], tokens: list[int], budget: int) -> bool:
        """Append ``tokens`` up to the first EOS or the budget; whether decoding goes on."""
        for t in tokens:
            out.append(t)
            if t in self.eos or len(out) >= budget:
                return False
        return True

    def _genai_decode(self, prompt: list[int], budget: int) -> list[int]:
        """A ``format="genai"`` folder: past and new concatenated, one step a token."""
        config = self._genai["decoder"]
        layers, heads, size = (
            config["num_hidden_layers"], config["num_key_value_heads"], config["head_size"]
        )  # fmt: skip
        half = self._decoder.get_inputs()[3].type == "tensor(float16)"
        dtype = np.float16 if half else np.float32
        past = {
            f"past_key_values.{i}.{kind}": np.zeros((1, heads, 0, size), dtype)
            for i in range(layers)
            for kind in ("key", "value")
        }
        names = [o.name for o in self._decoder.get_outputs()]
        tokens, out = prompt, []
        total = 0
        while True:
            total += len(tokens)
            feeds = {
                "input_ids": _ids(tokens),
                "attention_mask": np.ones((1, total), np.int64),
                "position_ids": _positions(total - len(tokens), len(tokens)),
                **past,
            }
            results = dict(zip(names, self._decoder.run(None, feeds), strict=True))
            self.last_stats["full_calls"] += 1
            past = {n.replace("present.", "past_key_values."): v for n, v in results.items()
                    if n != "logits"}  # fmt: skip
            x = _argmax(results["logits"][0, -1])
            if not self._emit(out, [x], budget):
                return out
            tokens = [x]

    # -- text in, text out ------------------------------------------------------------------

    def generate_text(self, text: str, max_new_tokens: int = 32) -> str:
        """``text`` encoded by the export's tokenizer, decoded greedily, the new tokens decoded
        back (special tokens skipped)."""
        if self.tokenizer is None:
            raise ValueError(
                f"path: {str(self.path)!r} holds no tokenizer.json; export with tokenizer= "
                "(leapfx export does) or call generate with token ids"
            )
        ids = self.tokenizer.encode(text).ids
        return self.tokenizer.decode(self.generate(ids, max_new_tokens))

    def __repr__(self) -> str:
        return f"Decoder({str(self.path)!r}, recipe={self.recipe!r})"


def _eos(manifest: dict[str, Any]) -> list[int]:
    gen = manifest.get("generation_config", {}).get("eos_token_id")
    if gen is None:
        return list(manifest.get("eos_token_ids", []))
    return [gen] if isinstance(gen, int) else list(gen)


def _is_genai(path: Path) -> bool:
    try:
        return json.loads((path / MANIFEST).read_text()).get("format") == GENAI_FORMAT
    except (OSError, ValueError, AttributeError):
        return False
