"""Triton source of the kernel report's yardstick: the shortest uniform draw in the project's counter layout.

Fifteen lines around Triton's own ``tl.philox``: program ``p`` computes the Philox blocks
``p * BLOCK ...`` (the block index in counter words 0 and 1, the 64-bit key as the seed), keeps a
word's top 24 bits, scales them by ``2**-32`` and stores the four lanes interleaved into one
contiguous float32 vector. On an NVIDIA H200 this kernel drew as fast as ``torch.rand`` (1.02x at
2**24 elements, 1.13x at 2**28) and gives the values of ``hyperrng.philox.uniform`` for offsets
that are multiples of 4: a draw kernel that takes no more instructions per element is at the
limit the card has shown. Compiled by :mod:`hyperrng.cli.bench.kernel_report` only, never run
by the library.
"""

import triton
import triton.language as tl


@triton.jit
def uniform_kernel(out_ptr, n, key, BLOCK: tl.constexpr):
    """``uniform`` float32 values of elements ``[4 * BLOCK * p, 4 * BLOCK * (p + 1))`` below ``n``."""
    block = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    c0 = block.to(tl.uint32)
    c1 = (block.to(tl.int64) >> 32).to(tl.uint32)
    zero = tl.zeros_like(c0)
    w0, w1, w2, w3 = tl.philox(key, c0, c1, zero, zero, 10)
    words = tl.interleave(tl.interleave(w0, w2), tl.interleave(w1, w3))
    values = (words & 0xFFFFFF00).to(tl.float32) * 2.3283064365386963e-10
    index = tl.program_id(0) * (4 * BLOCK) + tl.arange(0, 4 * BLOCK)
    tl.store(out_ptr + index, values, mask=index < n)
