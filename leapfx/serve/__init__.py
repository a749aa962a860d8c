"""``leapfx serve``: an OpenAI-compatible server whose concurrent requests decode as one batch,
each speculating at its own pace (continuous batching over ``runtime.batch.BatchDecode``).

    from leapfx.serve import create_app, Engine
    app = create_app(sm, tokenizer, model_name="smollm2", max_batch=8)   # FastAPI
    # uvicorn.run(app, host="127.0.0.1", port=8000)

Needs the ``serve`` extra (FastAPI, uvicorn). See docs/serving.md.
"""

from .engine import Engine, Job, QueueFull, Stopping

__all__ = ["Engine", "Job", "QueueFull", "Stopping", "create_app"]


def create_app(*args, **kwargs):
    """:func:`leapfx.serve.app.create_app` (imports FastAPI on first use)."""
    from .app import create_app as make

    return make(*args, **kwargs)
