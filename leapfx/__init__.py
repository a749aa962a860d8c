"""leapfx: compiler-style FX graph rewriting for early-exit and self-speculative decoding."""

__version__ = "0.1.0"
