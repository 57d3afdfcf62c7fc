"""Where the projected filter correction's forward time goes: each piece timed with CUDA events.

Runs on the tree of the commit that added it (the correction along 16 directions of c,
reverted by the next commit): ``PYTHONPATH=. python results/dev/h100_projected_forward_parts.py``.
Writes micro.json to $OUT (here: h100_projected_forward_parts.json)."""
import json, os, statistics, sys
import torch
import cce.lse_forward as lf
from cce.filter_correction import RANK, FilterCorrection, correction_directions
from cce.indexed_dot import indexed_dot
from cce.vocab_order import sort_and_project, target_positions
from cce.cce_function import forward_kernels
from experiments.synthetic import lm_like_inputs

def ms(fn, n=15, w=3):
    for _ in range(w): fn()
    out = []
    for _ in range(n):
        a = torch.cuda.Event(enable_timing=True); b = torch.cuda.Event(enable_timing=True)
        a.record(); fn(); b.record(); b.synchronize(); out.append(a.elapsed_time(b))
    return statistics.median(out)

rows = []
for name, n, v, d in (("gemma3", 8192, 262144, 640), ("llama3_8b", 8192, 128256, 4096),
                      ("phi3_5_mini", 8192, 32064, 3072), ("odd_d200", 1000, 5003, 200)):
    e, c, t = lm_like_inputs(n, v, d, seed=1, device="cuda")
    e, c = e.detach(), c.detach()
    r = {"shape": name}
    r["directions"] = ms(lambda: correction_directions(c))
    sample = torch.randn(d, RANK, device="cuda")
    r["qr_alone"] = ms(lambda: torch.linalg.qr(sample))
    U = correction_directions(c)
    r["order_only"] = ms(lambda: sort_and_project(e, c, None, t, sorts=True))
    r["order_and_projections"] = ms(lambda: sort_and_project(e, c, None, t, sorts=True, directions=U))
    order, proj = sort_and_project(e, c, None, t, sorts=True, directions=U)
    tl_ = indexed_dot(e, c, t, None, None)
    pos = target_positions(t, order)
    r["lse_plain"] = ms(lambda: lf.lse_forward(e, c, None, None, t, order, tl_))
    sums = {}
    for operands in ("tf32", "fp16"):
        lf._PROJECTION_OPERANDS = operands
        s = torch.empty(n, RANK, device="cuda")
        r[f"lse_projections_{operands}"] = ms(lambda: lf.lse_forward(
            e, c, None, None, t, order, tl_, projected_classifier=proj, target_positions=pos,
            projected_sums=s))
        lf.lse_forward(e, c, None, None, t, order, tl_, projected_classifier=proj,
                       target_positions=pos, projected_sums=s)
        sums[operands] = s.clone()
    lf._PROJECTION_OPERANDS = "tf32"
    r["fp16_vs_tf32_sums_rel"] = float((sums["fp16"] - sums["tf32"]).norm() / sums["tf32"].norm())
    for corrects in (False, True):
        r[f"forward_kernels_corrects_{corrects}"] = ms(lambda: forward_kernels(
            e, c, None, t, None, True, True, corrects=corrects))
    print(json.dumps(r), flush=True)
    rows.append(r)
    del e, c, t, order, proj
    torch.cuda.empty_cache()
json.dump(rows, open(os.environ.get("OUT", ".") + "/micro.json", "w"), indent=1)
