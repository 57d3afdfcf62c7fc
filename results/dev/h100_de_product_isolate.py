"""Where the dE product loop loses time: cce's loop (h100_de_product_study AHEAD=0) on operands that are
made cheaper one at a time (H100 study)."""
import json, os, sys
import torch
sys.path.insert(0, os.path.dirname(__file__))
from h100_de_product_study import run, ms, synthetic_chunk

rows = []
n, v, d, kept = 4096, 128256, 4096, 0.45
scratch, c, perm, flags, lists, counts = synthetic_chunk(n, v, d, kept)
cases = {
    "cce_loop": (lists, counts, perm),
    "order_identity": (lists, counts, torch.arange(v, device="cuda")),
    "c_rows_in_l2 (order -> first 4096 rows)": (lists, counts, perm % 4096),
    "a_tiles_in_l2 (every list entry 0..15)": (lists % 16, counts, perm),
    "both_in_l2": (lists % 16, counts, perm % 4096),
}
out = torch.empty(n, d, device="cuda", dtype=torch.bfloat16)
flop = 2 * counts.sum().item() * 128 * 128 * d
for name, (ls, cs, order) in cases.items():
    for stages, bo in ((2, 256), (3, 128)):
        run(0, scratch, ls, cs, c, order, out, n, stages, None, block_out=bo)
        t = ms(lambda: run(0, scratch, ls, cs, c, order, out, n, stages, None, block_out=bo))
        rows.append({"case": name, "stages": stages, "block_out": bo, "ms": t, "tflops": flop / t / 1e9})
        print(rows[-1], flush=True)
a = torch.randn(n, int(counts.float().mean().item()) * 128, device="cuda").bfloat16()
bm = torch.randn(a.shape[1], d, device="cuda").bfloat16()
t = ms(lambda: a @ bm)
rows.append({"case": "cublas same work", "ms": t, "tflops": 2 * a.shape[0] * a.shape[1] * d / t / 1e9})
print(rows[-1])
json.dump(rows, open(os.environ.get("OUT", ".") + "/de_isolate.json", "w"), indent=1)
