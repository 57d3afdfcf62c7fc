"""Can a tile stage for wgmma be filled row by row by TMA, one box per gathered row of c?
(compile-only probe for sm_90, no GPU needed; output in sm90_row_tma_probe.log).

dE's products read rows of c through the vocabulary order, which a TMA box cannot gather
(docs/notes/backward.md, "What feeds the products"). One TMA copy per row, each a [1, 64] box
into row r of a 128-byte-swizzled [64, 64] stage, would keep the rows' copies off the threads.
The probe compiles the whole-tile copy and the row-by-row copy with Triton's Gluon for sm_90.

Run: ``python results/dev/sm90_row_tma_probe.py`` (Triton 3.6 with Gluon).
"""
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource

ROWS = 64
COLS = 64

@gluon.jit
def row_copy(row_desc, tile_desc, order_ptr, out_ptr, ROWS: gl.constexpr, COLS: gl.constexpr, BY_ROW: gl.constexpr):
    layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    smem = gl.allocate_shared_memory(gl.bfloat16, [ROWS, COLS], layout)
    bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(bar, count=1)
    mbarrier.expect(bar, ROWS * COLS * 2)
    if BY_ROW:
        for r in gl.static_range(ROWS):
            row = gl.load(order_ptr + r)
            tma.async_copy_global_to_shared(row_desc, [row, 0], bar, smem.slice(r, 1, dim=0))
    else:
        tma.async_copy_global_to_shared(tile_desc, [0, 0], bar, smem)
    mbarrier.wait(bar, 0)
    blocked: gl.constexpr = gl.BlockedLayout([1, 8], [8, 4], [4, 1], [1, 0])
    vals = smem.load(blocked)
    rows = gl.arange(0, ROWS, layout=gl.SliceLayout(1, blocked))
    cols = gl.arange(0, COLS, layout=gl.SliceLayout(0, blocked))
    gl.store(out_ptr + rows[:, None] * COLS + cols[None, :], vals)

layout = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
sig = {"row_desc": f"tensordesc<bf16[1, {COLS}],{layout!r}>", "tile_desc": f"tensordesc<bf16[{ROWS}, {COLS}],{layout!r}>",
       "order_ptr": "*i32", "out_ptr": "*bf16", "ROWS": "constexpr", "COLS": "constexpr", "BY_ROW": "constexpr"}
for by_row in (False, True):
    src = GluonASTSource(row_copy, sig, {"ROWS": ROWS, "COLS": COLS, "BY_ROW": by_row}, {})
    try:
        k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
        ptx = k.asm["ptx"]
        print("by_row", by_row, "ok: tma copies", ptx.count("cp.async.bulk.tensor"), "shared", k.metadata.shared)
    except Exception as ex:
        print("by_row", by_row, "FAILED:", str(ex)[:1500])
