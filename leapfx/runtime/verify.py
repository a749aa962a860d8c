"""The acceptance rules: they live with the kernels that compute them
(:mod:`leapfx.kernels.reference`), the torch references of those ops."""

from ..kernels.reference import (  # noqa: F401
    acceptance,
    greedy_accept,
    speculative_accept,
    speculative_accept_random,
)
