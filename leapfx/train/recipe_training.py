"""The trainers of the recipes with trained parts, by the name a recipe gives them.

``SpeculativeModel.fit`` and ``save_parts`` call the recipe's ``training`` factory
(``runtime.recipe_info.RecipeTraining``). The recipes (``leapfx.recipes``) sit a floor below
``train``, so they name their trainer instead of importing it, and ``rewrite.load_training``
(a floor above) resolves the name here when the model first asks (decoding never imports
training code).

    >>> training("kangaroo").fit(sm, token_ids)  # what sm.fit(token_ids) does for kangaroo
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..runtime.recipe_info import RecipeTraining
from . import eagle, kangaroo, m2r2, specee


@dataclass(frozen=True)
class Training:
    """A recipe's training hook (``runtime.recipe_info.RecipeTraining``): its trainer module's
    ``fit(model, data, **options)`` and the function that writes the parts it trained."""

    fit_parts: Callable[..., Any]
    save_parts: Callable[[Any, Any], Any]

    def fit(self, model, data: Any, **options: Any) -> Any:
        return self.fit_parts(model, data, **options)

    def save(self, model, path) -> Any:
        return self.save_parts(model, path)


# name -> trainer (the recipes m2r2 and m2r2_exit both name "m2r2").
TRAININGS: dict[str, Training] = {
    "eagle": Training(eagle.fit, eagle.save_parts),
    "kangaroo": Training(kangaroo.fit, kangaroo.save_adapter),  # sm.save_adapter as well
    "m2r2": Training(m2r2.fit, m2r2.save_parts),
    "specee": Training(specee.fit, specee.save_parts),
}


def training(name: str) -> RecipeTraining:
    """The trainer for the parts of recipes that name ``name`` (``Recipe.training``)."""
    if name not in TRAININGS:
        raise ValueError(f"training: unknown trainer {name!r}; available: {', '.join(TRAININGS)}")
    return TRAININGS[name]
