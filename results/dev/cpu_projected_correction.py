"""What gradient filtering drops from dE, and how much of it each estimate puts back (CPU,
float32). Writes results/dev/cpu_projected_correction.json.

    PYTHONPATH=. python results/dev/cpu_projected_correction.py [N]

Inputs: the first N (default 2048) tokens of real Gemma 3 270M hidden states on Alpaca, prompt
tokens ignored (experiments.real_model). Each 128-token block's vocabulary tiles (128 positions
in cce's order) are dropped when every |G| entry of the block is below 2^-12 and the tile holds
no target, as the kernels' exact filter does. R, the dropped part of each row's dE, is compared
with estimates of it; the error is ||R - estimate|| / ||dE|| over the valid rows (the filter's
share of the dE error; the kernels' bf16 rounding adds to it in quadrature).
- none: the paper's filter. mean_row: cce's correction, dropped mass x mean row of c.
- mean_row_plus_top{r}_exact: as mean_row, with R's component in the span of the top r
  principal directions of c (centred) put back exactly.
- mean_row_plus_randomized16_passes{p}_exact: the same in a 16-dimensional span found by p
  passes of C^T C over a random start (a randomized range finder), as a kernel could afford.
- bands_{k}: each row's dropped mass in k bands of positions x each band's mean row.
- prior_bands_{k}: the same with band means weighted by softmax of the average logit.
"""
import json, math, sys, time
import torch
from experiments.real_model import alpaca_embeddings
from cce.vocab_order import vocab_order

N = int(sys.argv[1]) if len(sys.argv) > 1 else 2048
EPS, T = 2.0 ** -12, 128
t0 = time.time()
e, c, targets = alpaca_embeddings(N, mask_prompt=True)
print(f"inputs {time.time() - t0:.0f} s, valid rows {(targets >= 0).sum().item()}", flush=True)
order = vocab_order(e, c, None, targets).long()
cs = c[order].float()                       # classifier in position order
V, D = cs.shape
pos_of = torch.empty_like(order); pos_of[order] = torch.arange(V)
valid = targets >= 0
tpos = torch.where(valid, pos_of[targets.clamp(min=0)], -1)
mean_logit = cs @ e[valid].float().mean(0)  # the sort key
prior = torch.softmax(mean_logit, 0)
BANDS = [1, 2, 4, 8, 16, 32]
band_of = {k: torch.arange(V) * k // V for k in BANDS}
band_mean = {k: torch.zeros(k, D).index_add_(0, band_of[k], cs)
             / torch.bincount(band_of[k], minlength=k)[:, None].float() for k in BANDS}
band_prior_mean = {k: torch.zeros(k, D).index_add_(0, band_of[k], cs * prior[:, None])
                   / torch.zeros(k).index_add_(0, band_of[k], prior)[:, None] for k in (1, 8)}
centred = cs - cs.mean(0)
_, eigenvectors = torch.linalg.eigh(centred.double().T @ centred.double())
principal = eigenvectors.flip(1).float()                    # D x D, by decreasing variance
RANKS = [4, 16, 64, 256]
# The same from a randomized range finder: U = orth((C^T C)^q C^T C Omega), q + 1 passes of
# C^T C over a random Omega (D x r): what a kernel could afford per call.
randomized = {}
for q in (0, 1):
    sketch = centred.T @ (centred @ torch.randn(D, 16, generator=torch.Generator().manual_seed(1)))
    for _ in range(q):
        sketch = centred.T @ (centred @ torch.linalg.qr(sketch).Q)
    randomized[q] = torch.linalg.qr(sketch).Q
sq = {}
def add(name, x):
    sq[name] = sq.get(name, 0.0) + float((x.double() ** 2).sum())
for start in range(0, N, T):
    rows = slice(start, min(start + T, N))
    v = valid[rows]
    if not v.any():
        continue
    z = e[rows].float() @ cs.T
    p = torch.softmax(z, 1)
    G = p.clone()
    r = torch.nonzero(v).squeeze(1)
    G[r, tpos[rows][r]] -= 1
    G[~v] = 0
    p = p * v[:, None]
    pad = (-V) % T
    Gp = torch.nn.functional.pad(G.abs(), (0, pad))
    tile_max = Gp.view(G.shape[0], -1, T).amax(dim=(0, 2))     # per vocabulary tile
    dropped_tiles = tile_max < EPS
    dropped_tiles[tpos[rows][r] // T] = False                   # a target's tile is always kept
    dropped_cols = dropped_tiles.repeat_interleave(T)[:V]       # positions in dropped tiles
    dE = G @ cs
    pd = p * dropped_cols                                       # dropped probabilities
    R = pd @ cs                                                 # what the filter drops
    m = pd.sum(1)
    add("dE", dE)
    add("none", R)
    residual = R - m[:, None] * cs.mean(0)
    add("mean_row", residual)
    for rank in RANKS:
        u = principal[:, :rank]
        add(f"mean_row_plus_top{rank}_exact", residual - (residual @ u) @ u.T)
    for q, u in randomized.items():
        add(f"mean_row_plus_randomized16_passes{q + 1}_exact", residual - (residual @ u) @ u.T)
    for k in BANDS:
        mk = torch.zeros(pd.shape[0], k).index_add_(1, band_of[k], pd)  # dropped mass per band
        add(f"bands_{k}", R - mk @ band_mean[k])
        if k in band_prior_mean:
            add(f"prior_bands_{k}", R - mk @ band_prior_mean[k])
    print(f"rows {start}-{rows.stop}: {time.time() - t0:.0f} s", flush=True)
out = {name: math.sqrt(val / sq["dE"]) for name, val in sq.items() if name != "dE"}
result = {"meta": {"device": "CPU, torch " + torch.__version__, "date": time.strftime("%Y-%m-%d"),
                   "inputs": "experiments.real_model.alpaca_embeddings(N, mask_prompt=True)",
                   "filter": "exact tile filter at 2^-12, 128 x 128 tiles, target tiles kept"},
          "rows": N, "valid": int(valid.sum()), "dE_rel_err_of_estimate": out}
print(json.dumps(result, indent=1))
with open("results/dev/cpu_projected_correction.json", "w") as f:
    json.dump(result, f, indent=1)
