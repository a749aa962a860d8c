"""The options of one ``leapfx bench`` run (``BenchConfig``: the CLI's flags, checked where
they enter) and the names they are checked against."""

from __future__ import annotations

from dataclasses import dataclass

from ..offload import DEFAULT_PREFETCH_LEAD
from ..options import check_bool
from .offload import offload_systems

BACKENDS = ("eager", "inductor", "onnxruntime")
SPLIT_VERIFY = ("auto", "on", "off")  # --onnx-split-verify
THREAD_POOLS = ("shared", "session")  # --onnx-thread-pool
# hf_prompt_lookup's prompt_lookup_num_tokens: the value HF's assisted-generation docs use.
HF_PROMPT_LOOKUP_TOKENS = 10
# Training-free drafters: one leapfx_<name> row each, at the recipe's default options.
TRAINING_FREE = ("lookup", "swift", "qspec", "auto")
BENCHED_RECIPES = (
    "autoregressive", "early_exit", "layerskip", "kangaroo", "eagle", "specee", "m2r2", "lookup",
    "swift", "qspec", "auto",
)  # fmt: skip


@dataclass(frozen=True)
class BenchConfig:
    """Options of one benchmark run (the CLI's flags)."""

    recipe: str = "layerskip"
    exit_layer: int | None = None  # None: the recipe's default
    num_speculations: int = 6
    max_new_tokens: int = 128
    temperature: float = 0.0  # 0: greedy; > 0: sampling rows with a distribution check
    # kangaroo runs: the adapter (None: untrained, initialised from layer l), its exit layer
    # (None: the adapter's or the recipe default) and eta (None: the adapter's or 0.6).
    # layerskip runs: eta > 0 adds a leapfx_layerskip_dynamic row with that threshold.
    adapter: str | None = None
    kangaroo_exit_layer: int | None = None
    confidence_threshold: float | None = None
    # m2r2 runs: the accelerator parts (None: untrained) and gamma (None: the recipe's 3); the
    # run also carries leapfx_layerskip (E, d) and leapfx_kangaroo (``adapter``, its own eta).
    parts: str | None = None
    m2r2_speculations: int | None = None
    m2r2_threshold: float | None = None  # leapfx_m2r2_exit's tau (None: the recipe's 0.8)
    m2r2_exit_gates: tuple[int, ...] | None = None  # its deciding gates (None: the parts')
    exit_parts: str | None = None  # leapfx_m2r2_exit's parts (None: ``parts`` if they serve it)
    # eagle runs: the EAGLE head's parts (None: untrained, copied from the last layer). The
    # leapfx_eagle row drafts with the parts' options (d, threshold) unless
    # confidence_threshold is given; the leapfx_kangaroo row beside it with the adapter's.
    eagle_parts: str | None = None
    # Which backend runs the leapfx stages: "eager" (PyTorch), "inductor" (every leapfx system's
    # stages compiled with torch.compile and warmed up before timing) or "onnxruntime" (every
    # leapfx system is exported to ONNX and runs in onnxruntime sessions). HF rows stay eager.
    backend: str = "eager"
    export_dir: str | None = None  # onnxruntime: where exports go (None: a temp dir)
    # onnxruntime intra-op threads for every onnxruntime row. None (auto): the faster of 1 and
    # torch's thread count, timed on the autoregressive export before the run (on a small
    # model one thread can beat several: the work per op is too small to split).
    onnx_threads: int | None = None
    # intra-op threads of a split verify's upper part (OnnxModel verify_threads), spinning
    # when above 1: None, the rows' own count; "auto", the faster of 1 and torch's thread count
    # timed per speculative export. Off by default: it takes a second core that the
    # autoregressive row does not use, and costs more than it gains when that core is busy.
    onnx_verify_threads: int | str | None = None
    # layerskip's verify on onnxruntime as two calls (OnnxModel split_verify: the draft stage,
    # then verify's upper part: one copy of the lower layers' weights in a round) or as the one
    # exported verify graph. "auto": the faster of the two, timed per export (which wins
    # depends on whether both copies fit the CPU's cache); "on" / "off": fixed.
    onnx_split_verify: str = "auto"
    # Where the onnxruntime rows' intra-op threads live (OnnxModel thread_pool): "shared" switches
    # this process's onnxruntime to one process-wide pool that every stage shares (the
    # `leapfx bench` command's default: its process decodes with leapfx only); "session", a
    # pool per session (the default here: a library call must not switch its caller's process).
    onnx_thread_pool: str = "session"
    # The GGUF file the model was loaded from: the llama_cpp and llama_cpp_lookup rows run
    # llama.cpp on it (leapfx.bench.llamacpp; greedy runs, llama-cpp-python installed). None:
    # no such rows.
    llama_cpp: str | None = None
    # eager and inductor leapfx rows: projections through leapfx's small-M CPU kernels
    # (leapfx.kernels.cpu). None: where they apply (a float32 model on a CPU) and build.
    cpu_kernels: bool | None = None
    repeats: int = 3
    warmup: int = 1
    hf_baselines: bool = True
    # Only the systems whose speed does not depend on acceptance (hf_greedy, hf_static,
    # leapfx_autoregressive on each backend): a model with random weights (--random-model).
    throughput_only: bool = False
    # specee runs: the parts directory (None: untrained predictors) and the exit threshold
    # (None: the parts' own).
    specee_parts: str | None = None
    specee_threshold: float | None = None
    # MoE models: the offload rows (leapfx.bench.offload) with this many expert slots per
    # layer (an integer, or a fraction in (0, 1] of each layer's experts); None: no such rows.
    offload_slots: int | float | None = None
    offload_m2r2_parts: str | None = None  # leapfx_offload_m2r2's rate-2 fast stream
    offload_dir: str | None = None  # where the disk tiers' files go (None: temporary files)
    offload_engine: str = "auto"  # OffloadOptions.engine: auto | native | thread
    offload_prefetch_lead: int | None = DEFAULT_PREFETCH_LEAD  # None: all at once
    offload_slow_dtype: str | None = None  # OffloadOptions.slow_dtype: None | auto | float16 | ...
    # the *_reuse rows' learned eviction (a ReuseProbe file; None: no such rows)
    offload_reuse_probe: str | None = None
    # leapfx_offload_layerskip's drafts a round; None: fitted to the slots
    # (``rewrite.fit_drafts_to_slots``), not the resident rows' num_speculations
    offload_num_speculations: int | None = None

    def validate(self) -> BenchConfig:
        checks = [
            ("--num-speculations", self.num_speculations, 1),
            ("--max-new-tokens", self.max_new_tokens, 1),
            ("--repeats", self.repeats, 1),
            ("--warmup", self.warmup, 0),
        ]
        for name, value, low in checks:
            if not isinstance(value, int) or value < low:
                raise ValueError(f"{name}: {value!r} is invalid; allowed: an integer >= {low}")
        if not self.temperature >= 0:
            raise ValueError(f"--temperature: {self.temperature!r} is invalid; allowed: >= 0")
        if self.onnx_threads is not None and (
            not isinstance(self.onnx_threads, int) or self.onnx_threads < 1
        ):
            raise ValueError(
                f"--onnx-threads: {self.onnx_threads!r} is invalid; allowed: auto or an "
                "integer >= 1"
            )
        vt = self.onnx_verify_threads
        if vt is not None and vt != "auto" and (not isinstance(vt, int) or vt < 1):
            raise ValueError(
                f"--onnx-verify-threads: {vt!r} is invalid; allowed: same, auto or an integer >= 1"
            )
        if self.onnx_split_verify not in SPLIT_VERIFY:
            raise ValueError(
                f"--onnx-split-verify: {self.onnx_split_verify!r} is invalid; allowed: "
                f"{', '.join(SPLIT_VERIFY)}"
            )
        if self.onnx_thread_pool not in THREAD_POOLS:
            raise ValueError(
                f"--onnx-thread-pool: {self.onnx_thread_pool!r} is invalid; allowed: "
                f"{', '.join(THREAD_POOLS)}"
            )
        if self.onnx_thread_pool == "shared" and self.onnx_verify_threads is not None:
            raise ValueError(
                f"--onnx-verify-threads: {self.onnx_verify_threads!r} gives verify's upper part a "
                "pool of its own; allowed with --onnx-thread-pool shared: same (or pass "
                "--onnx-thread-pool session)"
            )
        check_bool("--cpu-kernels", self.cpu_kernels, none=True, allowed="auto, on or off")
        names = self.backends
        bad = next((b for b in names if b not in BACKENDS), None)
        if bad is None and (not names or len(set(names)) < len(names)):
            bad = self.backend
        if bad is not None:
            raise ValueError(
                f"--backend: {bad!r} is invalid; allowed: one or more of "
                f"{', '.join(BACKENDS)}, comma-separated without repeats"
            )
        return self

    @property
    def recipes(self) -> tuple[str, ...]:
        """The recipes of ``recipe`` (a name, or several separated by commas): the rows of
        each, every row once."""
        return tuple(r.strip() for r in self.recipe.split(",") if r.strip())

    def offload_systems(self, exit_layer: int) -> dict:
        """The offload rows of this run (``leapfx.bench.offload.offload_systems``: row name ->
        recipe, offload options, recipe options), speculative ones exiting at ``exit_layer``."""
        return offload_systems(
            self.offload_slots, exit_layer=exit_layer,
            num_speculations=self.offload_num_speculations,
            m2r2_parts=self.offload_m2r2_parts, path=self.offload_dir,
            engine=self.offload_engine, reuse_probe=self.offload_reuse_probe,
            prefetch_lead=self.offload_prefetch_lead, slow_dtype=self.offload_slow_dtype,
        )  # fmt: skip

    @property
    def backends(self) -> tuple[str, ...]:
        """The backends of ``backend`` (a name, or several separated by commas)."""
        return tuple(b.strip() for b in self.backend.split(",") if b.strip())
