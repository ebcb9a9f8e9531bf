"""Seeding: stream seeds derived from the mesh (:mod:`~hyperrng.seeding.layout`), and the published
recipes of Megatron-core, slapo and d9d that existing runs reproduce (:mod:`~hyperrng.seeding.recipes`).

The recipes' names are importable from here, as they were when this was one module.
"""

from hyperrng.seeding.recipes import *  # noqa: F403 -- the recipes, as hyperrng.seeding exported them
from hyperrng.seeding.recipes import __all__ as __all__
