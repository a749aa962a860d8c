"""How the onnxruntime rows are tuned before they are timed: the intra-op thread count, the
split or whole verify graph, verify's own threads, each the faster of its choices on the
export, timed in turn so that drift on a shared machine falls on all of them."""

from __future__ import annotations

import logging
import statistics
import time

import torch

from ..lower.onnxruntime import OnnxModel

log = logging.getLogger(__name__)

# How much faster a split verify must time than the whole graph for --onnx-split-verify auto
# to choose it (fastest_split_verify): it makes two session calls a verify where the whole
# graph makes one, which its short timing does not show: where the two tie in that timing, the
# bench's decodes measure the split verify slower (numbers: docs/benchmarks.md).
SPLIT_MARGIN = 0.03


def fastest_onnx_threads(
    path: str, *, new_tokens: int = 32, repeats: int = 3
) -> tuple[int, dict[int, float]]:
    """The faster of 1 and ``torch.get_num_threads()`` onnxruntime intra-op threads on the
    export at ``path``, and each count's median seconds per token of its own schedule (a
    ``new_tokens`` greedy decode of a fixed prompt, one untimed call first, the counts timed in
    turn so drift on a shared machine falls on both)."""
    # Each count on pools of its own: onnxruntime's shared pool is sized once per process, for
    # the count this chooses (``onnx_model``).
    return _fastest_count(
        lambda t: onnx_model(path, t, thread_pool="session"), "threads",
        new_tokens=new_tokens, repeats=repeats,
    )  # fmt: skip


def onnx_model(path: str, threads: int | None, **kw):
    """The bench's OnnxModel. On pools of their own (``thread_pool="session"``, or None in a
    process not switched to the shared pool) more than one thread spins within a call
    (``spin``: handing each small op to a sleeping worker costs more than the op); on
    onnxruntime's process-wide pool (``"shared"``) its workers spin as onnxruntime says."""
    return OnnxModel(path, threads=threads, spin=threads is not None and threads > 1, **kw)


def fastest_verify_threads(
    path: str, threads: int | None, *, new_tokens: int = 32, repeats: int = 3
) -> tuple[int, dict[int, float]]:
    """As :func:`fastest_onnx_threads`, for the intra-op threads of verify's upper part alone
    (``OnnxModel(verify_threads=...)``; the other stages keep ``threads``): a verify call runs
    d+1 rows through the upper layers, work a second core can share where a one-token step's
    cannot."""

    def make(t: int):
        return onnx_model(path, threads, verify_threads=t)

    return _fastest_count(make, "verify threads", new_tokens=new_tokens, repeats=repeats)


def fastest_split_verify(
    path: str, threads: int | None, *, new_tokens: int = 64, repeats: int = 5
) -> tuple[bool, dict[str, float]]:
    """Whether layerskip's verify runs faster split (``OnnxModel(split_verify=True)``: the
    draft stage on the last draft, then verify's upper part) than as the one exported verify
    graph, on the export at ``path``, timed as :func:`fastest_onnx_threads` times thread
    counts, and chosen only where faster by more than ``SPLIT_MARGIN``; and each one's median
    seconds per token ({"split": s, "whole": s}).

    Splitting keeps one copy of the lower layers' packed weights in a round, where the whole
    graph reads its own copy besides the draft session's: it wins where both copies do not fit
    the CPU's cache (a 32 MB L3: 3.73 -> 3.20 ms a round on the reference model), and loses a
    session call where they do."""
    models = {
        "split": onnx_model(path, threads, split_verify=True),
        "whole": onnx_model(path, threads, split_verify=False),
    }
    _, per_token = _fastest(models, "verify", new_tokens=new_tokens, repeats=repeats)
    return per_token["split"] < per_token["whole"] * (1 - SPLIT_MARGIN), per_token


def _fastest_count(make, what: str, *, new_tokens: int, repeats: int):
    counts = sorted({1, torch.get_num_threads()})
    if len(counts) == 1:
        return counts[0], {}
    return _fastest({t: make(t) for t in counts}, what, new_tokens=new_tokens, repeats=repeats)


def _fastest(models: dict, what: str, *, new_tokens: int, repeats: int):
    """The key of the fastest of ``models`` (OnnxModels) and each one's median seconds per
    token: a ``new_tokens`` greedy decode of a fixed prompt, one untimed call of each first,
    the models timed in turn so that drift on a shared machine falls on all of them."""
    first = next(iter(models.values()))
    prompt = torch.arange(1, 9).remainder(first.manifest["vocab_size"]).view(1, -1)
    times: dict = {k: [] for k in models}
    for r in range(repeats + 1):
        for k, om in models.items():
            start = time.perf_counter()
            om.generate(prompt, max_new_tokens=new_tokens, do_sample=False, eos_token_id=[])
            if r:  # the first call of each is a warm-up
                times[k].append((time.perf_counter() - start) / new_tokens)
    per_token = {k: statistics.median(v) for k, v in times.items()}
    best = min(per_token, key=per_token.get)
    log.info("onnxruntime %s: %s (seconds per token: %s)", what, best, per_token)
    return best, per_token
