"""A load test of OpenAI-compatible servers: ``leapfx serve-bench``.

For each system (``leapfx serve`` with a recipe, or llama-cpp-python's OpenAI server on the
same GGUF file) a server is started as a subprocess; at each concurrency C, C clients stream
chat completions over the prompt set at once (each client takes the next prompt when its last
answer ends, until every prompt of the run has been answered once: ``--requests``), greedy.
Reported per (system, C): total completion tokens / wall time, time to first token (TTFT)
p50/p99, the gap between streamed chunks p50/p99 (what a reader sees between updates; a
leapfx chunk holds the tokens a round accepted), the mean time per output token after the
first (TPOT), and the answers' agreement with the first system's (same prompts, greedy).

Every server is started first; then the systems take turns at each level, for ``--passes``
passes, and a row is its system's median pass (``median_rows``), so that a ratio between two
systems is measured side by side, with its pass-by-pass range (``ratio_lines``).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path


@dataclass
class Stream:
    """One streamed answer as a client saw it."""

    text: str = ""
    tokens: int = 0
    ttft: float | None = None  # seconds from the request to the first content
    gaps: list[float] = field(default_factory=list)  # between content chunks
    seconds: float = 0.0
    error: str | None = None


def stream_chat(url: str, model: str, messages: list[dict], max_tokens: int) -> Stream:
    """One greedy streamed chat completion against ``url`` (…/v1), timed."""
    import httpx

    out = Stream()
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
    begin = last = time.perf_counter()
    chunks = 0
    try:
        with httpx.stream("POST", url + "/chat/completions", json=body, timeout=600) as r:
            if r.status_code != 200:
                out.error = f"HTTP {r.status_code}: {r.read()[:200]!r}"
                return out
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if event.get("usage"):
                    out.tokens = event["usage"].get("completion_tokens", 0)
                for choice in event.get("choices") or []:
                    text = (choice.get("delta") or {}).get("content")
                    if text:
                        now = time.perf_counter()
                        if out.ttft is None:
                            out.ttft = now - begin
                        else:
                            out.gaps.append(now - last)
                        last = now
                        out.text += text
                        chunks += 1
    except Exception as e:  # noqa: BLE001 - a failed request is a result of the run
        out.error = f"{type(e).__name__}: {e}"
    out.seconds = time.perf_counter() - begin
    if not out.tokens:
        out.tokens = chunks  # a server without usage in its stream: a chunk a token
    return out


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))]


def run_load(url: str, model: str, prompts: list[list[dict]], concurrency: int,
             max_tokens: int) -> tuple[dict, list[Stream]]:  # fmt: skip
    """``concurrency`` clients over ``prompts`` (each answered once); the row and the answers
    in prompt order."""
    answers: list[Stream | None] = [None] * len(prompts)
    lock = threading.Lock()
    nxt = [0]

    def client() -> None:
        while True:
            with lock:
                i = nxt[0]
                nxt[0] += 1
            if i >= len(prompts):
                return
            answers[i] = stream_chat(url, model, prompts[i], max_tokens)

    begin = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - begin
    done = [a for a in answers if a is not None]
    ok = [a for a in done if a.error is None]
    tokens = sum(a.tokens for a in ok)
    ttft = [a.ttft for a in ok if a.ttft is not None]
    gaps = [g for a in ok for g in a.gaps]
    tpot = [(a.seconds - a.ttft) / (a.tokens - 1) for a in ok if a.ttft and a.tokens > 1]
    row = {
        "concurrency": concurrency, "requests": len(prompts), "errors": len(done) - len(ok),
        "tokens": tokens, "seconds": wall, "tokens_per_second": tokens / wall,
        "ttft_p50": percentile(ttft, 50), "ttft_p99": percentile(ttft, 99),
        "chunk_gap_p50": percentile(gaps, 50), "chunk_gap_p99": percentile(gaps, 99),
        "tpot_mean": sum(tpot) / len(tpot) if tpot else None,
    }  # fmt: skip
    return row, done


def median_rows(passes: dict[tuple[str, int], list[tuple[dict, list[Stream]]]],
                systems: list[str], levels: list[int]) -> list[dict]:  # fmt: skip
    """A row per (system, C): the pass of median tokens/s (its latencies too), each pass's
    tokens/s beside it, and its answers' agreement with the first system's at C (first pass)."""
    rows = []
    for name in systems:
        for c in levels:
            runs = passes[(name, c)]
            ordered = sorted(runs, key=lambda run: run[0]["tokens_per_second"])
            row, answers = ordered[(len(ordered) - 1) // 2]
            base = passes[(systems[0], c)][0][1]
            rows.append({"system": name, **row, "agreement": agreement(base, answers),
                         "tokens_per_second_per_pass":
                             [run[0]["tokens_per_second"] for run in runs]})  # fmt: skip
    return rows


def ratio_lines(rows: list[dict], levels: list[int]) -> list[str]:
    """Each leapfx system's tokens/s over ``leapfx_autoregressive``'s at each C: the ratio of
    the median rows and the range of the pass-by-pass ratios (both ran in the same pass,
    seconds apart, so that range is how much the ratio moves on this machine)."""
    base = {r["concurrency"]: r for r in rows if r["system"] == "leapfx_autoregressive"}
    lines = []
    for row in rows:
        ar = base.get(row["concurrency"])
        if ar is None or row is ar or not row["system"].startswith("leapfx_"):
            continue
        mine, theirs = row["tokens_per_second_per_pass"], ar["tokens_per_second_per_pass"]
        per_pass = [a / b for a, b in zip(mine, theirs, strict=True) if b > 0]
        spread = f"; per pass {min(per_pass):.2f}-{max(per_pass):.2f}x" if per_pass else ""
        lines.append(
            f"{row['system']} at {row['concurrency']} stream(s): "
            f"{row['tokens_per_second'] / ar['tokens_per_second']:.2f}x "
            f"leapfx_autoregressive{spread}"
        )
    return lines


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """A server subprocess on a free port, waited for until ``/v1/models`` answers."""

    def __init__(self, argv: list[str], port: int, log: Path, timeout: float = 600) -> None:
        import httpx

        self.url = f"http://127.0.0.1:{port}/v1"
        self.log = log
        with open(log, "w") as f:
            self.proc = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT,
                                         env={**os.environ, "PYTHONUNBUFFERED": "1"})  # fmt: skip
        deadline = time.time() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited ({self.proc.returncode}); see {log}")
            try:
                if httpx.get(self.url + "/models", timeout=2).status_code == 200:
                    return
            except Exception:  # noqa: BLE001 - not up yet
                pass
            if time.time() > deadline:
                self.close()
                raise RuntimeError(f"the server did not answer in {timeout:.0f} s; see {log}")
            time.sleep(0.5)

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def leapfx_argv(model: str, recipe: str, port: int, max_batch: int, threads: int | None,
                extra: list[str]) -> list[str]:  # fmt: skip
    argv = [sys.executable, "-m", "leapfx.cli", "serve", "--model", model, "--recipe", recipe,
            "--port", str(port), "--max-batch", str(max_batch), *extra]  # fmt: skip
    if threads:
        argv += ["--threads", str(threads)]
    return argv


def llama_cpp_argv(gguf: str, port: int, max_batch: int, threads: int | None) -> list[str]:
    """llama-cpp-python's OpenAI server on ``gguf``: it decodes one request at a time (its
    server's design: one lock around the model); ``--interrupt_requests False`` so that a new
    request waits for the one streaming instead of cutting it off (its default)."""
    argv = [sys.executable, "-m", "llama_cpp.server", "--model", gguf, "--port", str(port),
            "--n_ctx", "4096", "--model_alias", "smollm2",
            "--interrupt_requests", "False"]  # fmt: skip
    if threads:
        argv += ["--n_threads", str(threads), "--n_threads_batch", str(threads)]
    return argv


def agreement(a: list[Stream], b: list[Stream]) -> float:
    """The share of answers whose texts are the same."""
    pairs = [(x, y) for x, y in zip(a, b, strict=True) if x.error is None and y.error is None]
    return sum(x.text == y.text for x, y in pairs) / len(pairs) if pairs else 0.0


def write_json(path: str, rows: list[dict], meta: dict) -> None:
    """Write ``{"meta", "rows"}`` to ``path`` through a temp name, then rename."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    os.replace(tmp, path)


def plot(rows: list[dict], path: str) -> None:
    """Throughput and p99 TTFT against concurrency, a line a system."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    for system in dict.fromkeys(r["system"] for r in rows):
        mine = [r for r in rows if r["system"] == system]
        xs = [r["concurrency"] for r in mine]
        a.plot(xs, [r["tokens_per_second"] for r in mine], marker="o", label=system)
        b.plot(xs, [r["ttft_p99"] or 0 for r in mine], marker="o", label=system)
    a.set(xlabel="concurrent streams", ylabel="total tokens/s", title="throughput")
    b.set(xlabel="concurrent streams", ylabel="seconds", title="time to first token, p99")
    a.legend()
    fig.tight_layout()
    tmp = f"{path}.tmp{os.getpid()}.png"
    fig.savefig(tmp)
    os.replace(tmp, path)


__all__ = ["Stream", "run_load", "stream_chat", "ServerProcess", "asdict"]
