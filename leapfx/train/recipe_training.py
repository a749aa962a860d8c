"""The trainers of the recipes with trained parts, by the name a recipe gives them.

``SpeculativeModel.fit`` and ``save_parts`` call the recipe's ``training`` factory
(``runtime.model.RecipeTraining``). The recipes (``leapfx.rewrite.recipes``) sit a floor below
``train``, so they name their trainer instead of importing it, and ``rewrite.recipes.trainer``
resolves the name here, in the one import of ``train`` that ``rewrite`` makes (lazily: decoding
never imports training code).

    >>> training("kangaroo").fit(sm, token_ids)  # what sm.fit(token_ids) does for kangaroo
"""

from __future__ import annotations

from ..runtime.model import RecipeTraining
from .eagle import EagleTraining
from .kangaroo import KangarooTraining
from .m2r2 import M2R2Training
from .specee import SpecEETraining

# name -> trainer (the recipes m2r2 and m2r2_exit both name "m2r2").
TRAININGS: dict[str, type] = {
    "eagle": EagleTraining,
    "kangaroo": KangarooTraining,
    "m2r2": M2R2Training,
    "specee": SpecEETraining,
}


def training(name: str) -> RecipeTraining:
    """A new trainer for the parts of recipes that name ``name`` (``Recipe.training``)."""
    if name not in TRAININGS:
        raise ValueError(f"training: unknown trainer {name!r}; available: {', '.join(TRAININGS)}")
    return TRAININGS[name]()
