"""The recipes as data: each a frozen options dataclass with ``validate()``, its passes, its
stage cut, its schedule, what it can be lowered to and which trainer fits its parts
(``table.py``; SpecEE's in ``specee.py``).

A floor of its own beneath ``lower/``: it imports passes and the runtime only, so that both
``rewrite.apply`` (which builds a model with a recipe) and ``lower.onnxruntime.OnnxModel``
(which decodes an export with the recipe its manifest names) read the same table.

    >>> get_recipe("kangaroo").options_type(exit_layer=2).validate(num_layers=8)
"""

from .table import RECIPES, Recipe, get_recipe, lookup_recipes

__all__ = ["RECIPES", "Recipe", "get_recipe", "lookup_recipes"]
