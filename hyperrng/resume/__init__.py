"""Resume: every rank's RNG state as a checkpoint, in memory and on disk.

:mod:`~hyperrng.resume.state` is the public side (``rng_state_dict``, ``load_rng_state_dict``, DCP's
``RNGStateful``, whose DCP planner is ``_dcp_planner``; ``save_rng_state`` and ``load_rng_state`` from
``_save_load``); ``_format`` checks a saved dict before anything is applied; ``_files`` writes a checkpoint through
an opened directory that ``_paths`` walks to; ``_untrusted`` checks a file before ``torch.load`` reads it, its
pickle walked by ``_pickle_check`` over the values of ``_pickle_values``.
"""
