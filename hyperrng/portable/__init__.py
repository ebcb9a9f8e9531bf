"""Portable mode: torch's own random ops draw :mod:`hyperrng.philox` numbers keyed by the global element index.

:mod:`~hyperrng.portable.mode` turns it on and off (``portable_random``); ``_ops`` holds the aten kernels
and the dispatch key they live on; :mod:`~hyperrng.portable.position` draws at the position of a
generator, a stream or a sharded op; ``_traced`` is what ``torch.compile`` records; ``_attention`` takes
over ``F.scaled_dot_product_attention``. :mod:`hyperrng.philox` is the generator itself, explicit keys only.
"""
