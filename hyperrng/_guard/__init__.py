"""Guards: one thread at a time borrows a device's generator (:mod:`~hyperrng._guard.exclusive`), and
signals wait while a few steps that must run whole do (:mod:`~hyperrng._guard.interrupts`)."""
