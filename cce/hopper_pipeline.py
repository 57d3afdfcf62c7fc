"""What the backward's two Gluon products on Hopper GPUs share (:mod:`cce.classifier_product`,
:mod:`cce.embeddings_product`): when they can run, the consumer side of their pipeline, and the
page-table arithmetic of their producers.

Both are warp-specialized: a producer partition of PRODUCER_WARPS warps copies each step's two
operands into a ring of shared-memory stages, and the consumer, two warp groups, multiplies
them with asynchronous wgmma into a float32 accumulator:

    producer, step k                        consumer, step k
      wait until stage k % STAGES is free     wait until stage k % STAGES is full
      copy both operands into it              acc += A @ B       (wgmma, asynchronous)
      look up step k + 1's addresses          wait for step k - 1's wgmma
                                              free stage (k - 1) % STAGES

The Gluon API changes between Triton releases; these kernels are built and tested on 3.6, and
the Triton products run everywhere else.
"""

from __future__ import annotations

import torch
import triton

from cce.config import interpreting
from cce.scratch import Scratch

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier,
                                                                  warpgroup_mma,
                                                                  warpgroup_mma_wait)
except ImportError:  # a Triton without Gluon: the Triton kernels run instead
    gluon = None

_TRITON_VERSIONS = ("3.6.",)
PRODUCER_WARPS = 4
PRODUCER_REGISTERS = 88


def available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether Gluon kernels can run for inputs of ``dtype`` on ``device``: a Hopper GPU,
    Triton 3.6 (not its interpreter) and 16-bit inputs."""
    return (gluon is not None
            and not interpreting() and triton.__version__.startswith(_TRITON_VERSIONS)
            and device.type == "cuda" and torch.cuda.get_device_capability(device)[0] == 9
            and dtype in (torch.bfloat16, torch.float16))


def copyable(matrix: torch.Tensor) -> bool:
    """Whether rows of ``matrix`` can be copied in 16-byte pieces (cp.async, TMA)."""
    return (matrix.stride(-1) == 1 and (matrix.stride(0) * matrix.element_size()) % 16 == 0
            and matrix.data_ptr() % 16 == 0)


def scratch_copyable(scratch: Scratch) -> bool:
    """Whether the stored tiles' segments can be copied in 16-byte pieces."""
    return (scratch.buffer.data_ptr() % 16 == 0
            and (scratch.page_stride * scratch.buffer.element_size()) % 16 == 0)


if gluon is not None:

    @gluon.constexpr_function
    def accumulator_layout(num_warps, block_out):
        """The wgmma accumulator's register layout: warp groups stacked along the rows."""
        return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                         instr_shape=[16, block_out, 16])

    @gluon.jit
    def segment_starts(pages_ptr, segments, mask, page_stride,
                       SEGMENTS_PER_PAGE: gl.constexpr, BLOCK: gl.constexpr,
                       IN_ORDER: gl.constexpr):
        """Element offsets where the given segments start in the scratch: the Gluon twin of
        :func:`cce.scratch.segment_offsets` (a Triton function, which Gluon cannot call)."""
        if IN_ORDER:
            starts = segments * BLOCK
        else:
            page = gl.load(pages_ptr + segments // SEGMENTS_PER_PAGE, mask=mask, other=0)
            starts = page.to(gl.int64) * page_stride + (segments % SEGMENTS_PER_PAGE) * BLOCK
        return starts

    @gluon.jit
    def multiply_steps(a_smem, b_smem, ready, empty, n_steps, BLOCK: gl.constexpr,
                       BLOCK_OUT: gl.constexpr, STAGES: gl.constexpr,
                       TRANSPOSED_A: gl.constexpr):
        """The consumer: ``acc (BLOCK x BLOCK_OUT) += A @ B`` over the steps, A being the
        stage's first operand, or its transpose with TRANSPOSED_A."""
        acc = gl.zeros([BLOCK, BLOCK_OUT], gl.float32,
                       layout=accumulator_layout(gl.num_warps(), BLOCK_OUT))
        for step in range(n_steps):
            stage = step % STAGES
            mbarrier.wait(ready.index(stage), (step // STAGES) & 1)
            fence_async_shared()  # the cp.async writes, before the tensor cores read them
            if TRANSPOSED_A:
                a = a_smem.index(stage).permute((1, 0))
            else:
                a = a_smem.index(stage)
            acc = warpgroup_mma(a, b_smem.index(stage), acc, is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc, ))
            # Both warp groups are done with the previous stage: free it.
            gl.thread_barrier()
            mbarrier.arrive(empty.index((step + STAGES - 1) % STAGES), pred=step > 0)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
        return (acc, )
