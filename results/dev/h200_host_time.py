"""Host time per launcher in one forward+backward call, without a profiler: each launcher wrapped
in a timer, and the time the host waits at its two syncs (the targets' range flag, the list
lengths), per call, mean of 10 calls (H200 study; output in h200_host_time.log).

Run from the repository root: ``python results/dev/h200_host_time.py``.
"""
import time, statistics, functools
from collections import defaultdict
import torch
import cce, cce.backward, cce.cce_function, cce.loss, cce.sparse_tile_matmul, cce.host_copy
from experiments.synthetic import lm_like_inputs

acc = defaultdict(lambda: [0, 0.0])
def wrap(module, name, label):
    original = getattr(module, name)
    @functools.wraps(original)
    def timed(*a, **k):
        t = time.perf_counter()
        try:
            return original(*a, **k)
        finally:
            acc[label][0] += 1
            acc[label][1] += time.perf_counter() - t
    setattr(module, name, timed)

for mod, name in [(cce.cce_function, "vocab_order"), (cce.cce_function, "target_positions"),
                  (cce.cce_function, "indexed_dot"), (cce.cce_function, "lse_forward"),
                  (cce.cce_function, "live_tiles"),
                  (cce.backward, "gradient_tiles"), (cce.backward, "gradient_times_embeddings"),
                  (cce.backward, "listed_gradient_tiles"), (cce.backward, "gradient_times_classifier"),
                  (cce.sparse_tile_matmul, "live_lists"), (cce.sparse_tile_matmul, "sum_partials"),
                  (cce.backward, "_list_tiles"), (cce.backward, "_one_pass_plan"),
                  (cce.backward, "linear_cross_entropy_backward")]:
    wrap(mod, name, name)

orig_start = cce.host_copy.start_host_copy
def start(tensor):
    read = orig_start(tensor)
    def timed_read():
        t = time.perf_counter()
        try:
            return read()
        finally:
            acc["sync wait"][0] += 1
            acc["sync wait"][1] += time.perf_counter() - t
    return timed_read
cce.backward.start_host_copy = start
cce.loss.start_host_copy = start

for name, n, v, d in [("gemma3", 8192, 262144, 640), ("phi", 8192, 32064, 3072),
                      ("llama", 8192, 128256, 4096), ("llama1024", 1024, 128256, 4096)]:
    e, c, t = lm_like_inputs(n, v, d, seed=1, device="cuda")
    def step():
        loss = cce.linear_cross_entropy(e, c, t)
        t1 = time.perf_counter()
        loss.backward()
        acc["backward (autograd)"][0] += 1; acc["backward (autograd)"][1] += time.perf_counter() - t1
        e.grad = c.grad = None
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    acc.clear()
    R = 10
    walls, gpu = [], []
    for _ in range(R):
        torch.cuda.synchronize()
        s, en = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0 = time.perf_counter(); s.record()
        step()
        en.record(); walls.append((time.perf_counter() - t0) * 1e3)
        en.synchronize(); gpu.append(s.elapsed_time(en))
    print(f"== {name}: events {statistics.median(gpu):.2f} ms, host wall {statistics.median(walls):.2f} ms")
    for label, (count, total) in sorted(acc.items(), key=lambda x: -x[1][1]):
        print(f"   {label:32s} {count/R:5.1f} calls  {total/R*1e3:7.3f} ms/call-of-loss")
