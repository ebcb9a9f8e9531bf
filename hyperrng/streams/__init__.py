"""Streams: named RNG states that code borrows, and everything that swaps a device's generator.

:mod:`~hyperrng.streams.tracker` holds the named streams and their forks (Megatron-core's and
TransformerEngine's ``tracker.fork(name)``); :mod:`~hyperrng.streams.fork` is ``fork_rng`` for any
platform; :mod:`~hyperrng.streams.recompute` replays a forward pass's numbers in activation recompute.
How a fork puts a stream into the generator (``_swap``), the saved host and device states
(``_device_state``) and which activation checkpoint the thread is in (``_checkpoints``) serve them.
"""
