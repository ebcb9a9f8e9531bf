"""Resume: every rank's RNG state as a checkpoint, in memory and on disk.

:mod:`~hyperrng.resume.state` is the public side (``rng_state_dict``, ``save_rng_state``, DCP's
``RNGStateful``); ``_format`` checks a saved dict before anything is applied; ``_files`` writes and reads
through an opened directory; ``_untrusted`` checks a file before ``torch.load`` reads it.
"""
