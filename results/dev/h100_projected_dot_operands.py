"""The forward's projection dot: operand types and column counts, checked against float64 sums
and timed. Runs on the tree of the commit that added it (the projected filter correction,
reverted by the next commit), with that tree's variant switch ``cce.lse_forward._PROJECTION_OPERANDS``. Its results: h100_projected_dot_operands.json."""
import json, os, statistics
import torch
import cce.lse_forward as lf
from cce.filter_correction import RANK, correction_directions
from cce.indexed_dot import indexed_dot
from cce.vocab_order import sort_and_project, target_positions
from experiments.synthetic import lm_like_inputs

def ms(fn, n=12, w=3):
    for _ in range(w): fn()
    out = []
    for _ in range(n):
        a = torch.cuda.Event(enable_timing=True); b = torch.cuda.Event(enable_timing=True)
        a.record(); fn(); b.record(); b.synchronize(); out.append(a.elapsed_time(b))
    return statistics.median(out)

rows = []
for name, n, v, d, timed in (("odd_d200", 1000, 5003, 200, False), ("odd_d1000", 2000, 30011, 1000, False),
                             ("gemma3", 8192, 262144, 640, True), ("llama3_8b", 8192, 128256, 4096, True),
                             ("phi3_5_mini", 8192, 32064, 3072, True)):
    e, c, t = lm_like_inputs(n, v, d, seed=1, device="cuda")
    e, c = e.detach(), c.detach()
    U = correction_directions(c)
    order, proj = sort_and_project(e, c, None, t, sorts=True, directions=U)
    tl_ = indexed_dot(e, c, t, None, None)
    pos = target_positions(t, order)
    # float64 reference: softmax @ cU without the target's term
    cs = c[order.long()].double(); pu = proj.double()
    logits = e.double() @ cs.T
    p = torch.softmax(logits, 1)
    p[torch.arange(n, device="cuda"), pos.long().clamp(min=0)] *= (pos >= 0).double().logical_not().double()
    ref = p @ pu
    del logits, p, cs
    r = {"shape": name}
    if timed:
        r["lse_plain"] = ms(lambda: lf.lse_forward(e, c, None, None, t, order, tl_))
    for operands in ("tf32", "fp16", "bf16"):
        for cols in (16, 32):
            lf._PROJECTION_OPERANDS = operands
            pr = torch.nn.functional.pad(proj, (0, cols - RANK)).contiguous()
            s = torch.empty(n, cols, device="cuda")
            call = lambda: lf.lse_forward(e, c, None, None, t, order, tl_, projected_classifier=pr,
                                          target_positions=pos, projected_sums=s)
            call()
            r[f"err_{operands}_{cols}"] = float((s[:, :RANK].double() - ref).norm() / ref.norm())
            if timed:
                r[f"ms_{operands}_{cols}"] = ms(call)
    lf._PROJECTION_OPERANDS = "tf32"
    if timed:
        r["directions"] = ms(lambda: correction_directions(c))
    print(json.dumps(r), flush=True)
    rows.append(r)
    del e, c, t, order, proj
    torch.cuda.empty_cache()
json.dump(rows, open(os.environ.get("OUT", ".") + "/micro2.json", "w"), indent=1)
