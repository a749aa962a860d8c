"""Near-tie flips: where two greedy decoders part, was it float rounding or a bug?

Two decoders that compute the same function can still pick different tokens where the top two
logits tie within float error. A verify pass runs several positions through one matmul, which
sums in a different order than one-token steps; a GPU picks a kernel per query length; half
precision rounds every hidden state to 8 (bfloat16) or 11 (float16) significant bits. At the
first position where two greedy outputs differ, :func:`first_difference` runs the full model on
the common prefix and measures the gap between the two candidates' logits: within the dtype's
tolerance of a tie (relative to the logit scale) the divergence is a *near-tie flip*; above it
the outputs differ for a reason rounding does not explain.

Exact losslessness is proven on a CPU in float32/float64 by the property tests
(``tests/greedy_check.py`` accepts a divergence only at such a measured tie); the bench uses the
same measurement to explain every difference it reports.

>>> d = first_difference(hf_model, ours, ref, prompt_len=64)   # None if the outputs are equal
>>> d["new_token"], d["logit_gap"], d["near_tie"]
"""

from __future__ import annotations

import torch

# |logit gap| below this share of the logit scale (max |logit|, at least 1) is a float tie in
# float32/float64: what the property tests accept (tests/greedy_check.py).
TIE_TOL = 1e-4
# Half precision: four machine epsilons of the dtype. Rounding the hidden state the head reads
# already moves a logit by about one epsilon of the scale, and each layer adds its own rounding.
HALF_TIE_TOL = {torch.bfloat16: 4 * 2.0**-7, torch.float16: 4 * 2.0**-10}


def tie_tolerance(dtype: torch.dtype) -> float:
    """Relative logit-gap tolerance of a tie for a model computing in ``dtype``.

    >>> tie_tolerance(torch.float32), tie_tolerance(torch.bfloat16)
    (0.0001, 0.03125)
    """
    return HALF_TIE_TOL.get(dtype, TIE_TOL)


def logit_gap(model, prefix: torch.Tensor, a: int, b: int) -> tuple[float, float]:
    """``(|logit_a - logit_b|, max |logit|)`` of the full model's next-token logits after
    ``prefix`` [1, t], computed in the model's dtype and compared in float64."""
    with torch.inference_mode():
        logits = model(input_ids=prefix, use_cache=False).logits[0, -1].double()
    return float((logits[a] - logits[b]).abs()), float(logits.abs().max())


def is_near_tie(gap: float, scale: float, dtype: torch.dtype) -> bool:
    """Whether a logit gap is within ``dtype``'s tolerance of a tie at this logit scale."""
    return gap <= tie_tolerance(dtype) * max(1.0, scale)


def first_difference(model, ours: torch.Tensor, ref: torch.Tensor, prompt_len: int) -> dict | None:
    """Where ``ours`` [1, n] first differs from ``ref`` [1, m] (both prompt + new tokens), and
    whether the two candidates there are a near tie under ``model``; None if they are equal.

    Returns ``{"new_token": k, "ours": a, "reference": b, "logit_gap": g, "logit_scale": s,
    "tolerance": tol, "near_tie": bool}``, ``k`` counted from the first new token. Outputs
    that agree up to the shorter one's end (one stopped earlier) give ``ours``/``reference``
    None and ``near_tie`` False: no tie can explain a length difference.
    """
    if torch.equal(ours, ref):
        return None
    n = min(ours.shape[1], ref.shape[1])
    diff = (ours[0, :n] != ref[0, :n]).nonzero()
    dtype = next(model.parameters()).dtype
    tol = tie_tolerance(dtype)
    if len(diff) == 0:
        return {"new_token": n - prompt_len, "ours": None, "reference": None,
                "logit_gap": None, "logit_scale": None, "tolerance": tol,
                "near_tie": False}  # fmt: skip
    t = int(diff[0])
    if t < prompt_len:
        raise ValueError(f"ours and reference differ inside the prompt (position {t})")
    a, b = int(ours[0, t]), int(ref[0, t])
    gap, scale = logit_gap(model, ours[:, :t], a, b)
    return {"new_token": t - prompt_len, "ours": a, "reference": b, "logit_gap": gap,
            "logit_scale": scale, "tolerance": tol,
            "near_tie": is_near_tie(gap, scale, dtype)}  # fmt: skip
