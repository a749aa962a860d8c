"""The options of a recipe's ``fit``: checked against its config dataclass before training.

Every trainer of inserted parts (Kangaroo's adapter, the EAGLE head, SpecEE's predictors, M2R2's
accelerators) takes ``sm.fit(data, **options)`` with the fields of its own frozen config; an
unknown option fails at once and lists the valid ones.

    >>> config = fit_config(KangarooFitConfig, {"steps": 200}, model=sm.hf_model)

Each trainer's ``fit`` is wrapped in :func:`on_plain_stages`: where the model's eager stages run
leapfx's CPU kernels (``rewrite.apply``'s default on a float32 CPU model), they hold packed
copies of weights that training changes, so training runs on the plain stages and the kernel
stages are packed again from the trained weights afterwards. The drafter trainers' ``fit``
(Kangaroo's, EAGLE's, M2R2's) share one front, :func:`parts_fit`: the same keyword arguments,
the options checked into the config, and training on plain stages.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from collections.abc import Callable, Sequence
from typing import Any


def on_plain_stages(fit: Callable) -> Callable:
    """``fit(sm, ...)`` with ``sm``'s CPU kernels off while it trains, packed again after it
    returns. A fit that raises leaves the plain stages (correct, slower; packing could fail
    the same way and hide its error): ``sm.use_cpu_kernels()`` turns them on again."""

    @functools.wraps(fit)
    def run(sm, *args: Any, **kwargs: Any) -> Any:
        kernels = sm.backend == "eager" and sm.cpu_kernels
        if kernels:
            sm.use_cpu_kernels(False)
        result = fit(sm, *args, **kwargs)
        if kernels:
            sm.use_cpu_kernels()  # from the trained weights
        return result

    return run


def parts_fit(config_type: type) -> Callable[[Callable], Callable]:
    """The front every drafter trainer's ``fit`` shares (Kangaroo's, EAGLE's, M2R2's):
    ``fit(sm, data, *, tokenizer=None, eval_data=None, checkpoint_dir=None, **options)`` checks
    ``options`` against ``config_type`` (:func:`fit_config`) and calls the decorated
    ``train(sm, data, config, tokenizer, eval_data, checkpoint_dir)``, on plain stages
    (:func:`on_plain_stages`)."""

    def wrap(train: Callable) -> Callable:
        def fit(
            sm, data: Any, *, tokenizer=None, eval_data: Any = None, checkpoint_dir=None,
            **options: Any,
        ) -> Any:  # fmt: skip
            also = ("tokenizer", "eval_data", "checkpoint_dir")
            config = fit_config(config_type, options, also=also, model=sm.hf_model)
            return train(sm, data, config, tokenizer, eval_data, checkpoint_dir)

        for name in ("__module__", "__name__", "__qualname__", "__doc__"):
            setattr(fit, name, getattr(train, name))  # not __wrapped__: fit's signature stands
        return on_plain_stages(fit)

    return wrap


def fit_config(
    config_type: type,
    options: dict[str, Any],
    *,
    also: Sequence[str] = ("tokenizer",),
    model=None,
) -> Any:
    """``config_type(**options)`` after checking every name; ``also``: the keyword arguments
    ``fit`` takes besides the config's fields (listed in the error). With ``model``: warn when
    it is in training mode (dropout makes the targets noisy)."""
    fields = {f.name for f in dataclasses.fields(config_type)}
    unknown = sorted(set(options) - fields)
    if unknown:
        raise ValueError(
            f"option {unknown[0]!r} is not an option of fit; its options are: "
            f"{', '.join([*also, *sorted(fields)])}"
        )
    if model is not None and model.training:
        warnings.warn(
            "the model is in training mode (dropout active): the targets are noisy; call "
            "model.eval() first",
            stacklevel=3,
        )
    return config_type(**options)


def optimizer_step(optimizer, loss, params, grad_clip: float) -> None:
    """One step of a parts trainer: gradients of ``loss``, clipped to ``grad_clip`` (<= 0: not
    clipped) over ``params``, then the optimizer's update."""
    import torch

    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    if grad_clip > 0:
        torch.nn.utils.clip_grad_norm_(params, grad_clip)
    optimizer.step()
