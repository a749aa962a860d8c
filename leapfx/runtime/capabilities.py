"""What a recipe's stages can be lowered to: declared on the recipe, asked by lowering and export.

A recipe (``leapfx.recipes.Recipe``) declares its ``Capabilities``; ``rewrite.apply``
hands them to the ``SpeculativeModel`` in its ``RecipeInfo`` (``sm.recipe.capabilities``), so
that lowering (``leapfx.lower``) and export (``leapfx.export``), which sit below ``rewrite``,
ask the model instead of branching on recipe names.

    >>> sm = rewrite.apply(hf_model, "layerskip", exit_layer=2)
    >>> sm.recipe.capabilities.has_chain
    True
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Capabilities:
    """What a recipe's stages support besides eager decoding (the defaults: a plain recipe)."""

    # Its stages lower to Inductor (False: a stage takes a Python object, e.g. M2R2's
    # FastScratch, that it does not trace, or its Inductor path is not written).
    compiles: bool = True
    # Why not, where ``compiles`` is False (the refusal quotes it).
    eager_reason: str = "a stage takes a Python object that Inductor does not trace"
    # Its stages export to ONNX and the onnxruntime executor runs its schedule; where not,
    # ``export_refusal`` says what is missing (the export's ValueError quotes it).
    exportable: bool = True
    export_refusal: str = ""
    # Where some of its options' models cannot export although the recipe can (swift's
    # online search): options -> why not, or None. The export's ValueError quotes it.
    export_refusal_for: Callable[[Any], str | None] | None = None
    # Its greedy rounds draft d tokens one ``draft`` call each, the argmax between calls:
    # one ``draft_chain`` executor of d unrolled steps may replace them (compiled, eager
    # kernel and ONNX lowerings build one).
    has_chain: bool = False
    # Its per-layer stages (``layer_i`` ...) compile as segments of one call each
    # (``leapfx.lower.specee_segments``) instead of one graph per stage.
    layer_segments: bool = False
    # Its ``draft`` stage is verify's lower part (``hidden``: the exit states verify joins to
    # the cached ones), so onnxruntime may run verify as that stage plus an upper part.
    split_verify: bool = False

    def __post_init__(self) -> None:
        if not self.exportable and not self.export_refusal:
            raise ValueError("export_refusal: say what is missing where exportable is False")

    def refusal(self, options: Any) -> str | None:
        """Why a model of the recipe with ``options`` does not export (``format="leapfx"``),
        or None where it does."""
        if not self.exportable:
            return self.export_refusal
        return None if self.export_refusal_for is None else self.export_refusal_for(options)
