"""What would today's structure take if each of its kernels ran at cuBLAS's speed? (CPU, from
committed data; no timing of its own.)

For each shape of ``results/roofline.json`` (H100), every step with a cuBLAS counterpart (the
log-sum-exp forward, the recomputes, the dE and dC products) is given the time cuBLAS takes for
the same work ("cuBLAS ms, same work"); the other steps (the vocabulary order, the target logits,
the table of tiles, the rest of the call) keep their measured time. The sum is forward + backward
with every GEMM-like kernel at 100% of cuBLAS, and the same without the second recompute (each
live tile recomputed once, as ``keep_tiles=True`` does with more memory). The rest of the call
(the roofline's "everything else", a remainder of the traced call) counts less the host time that
tracing added (traced minus untraced call), which makes the bound, if anything, optimistic.
Against it: the fwd+bwd target, ``limit x torch.compile`` with torch.compile's time from
``results/bench.json`` (same H100 type, bf16, N as in the shape; torch.compile's time does not
depend on the inputs' values).

``needed of cuBLAS`` is the fraction of cuBLAS's speed that the GEMM-like kernels would need on
average for the target, with the other steps as measured: above 1, the target is out of this
structure's reach at any kernel speed.

The forward's target (at most 1.15 one-GEMM times) likewise: the log-sum-exp kernel at cuBLAS's
speed next to the order's and the target logits' kernel times.

``python results/dev/cpu_target_bounds.py`` writes ``cpu_target_bounds.{json,md}`` beside itself.
"""

import json
from pathlib import Path

HERE = Path(__file__).parent
RESULTS = HERE.parent

# Roofline shape -> (bench shape, fwd+bwd target as a fraction of torch.compile's time).
SHAPES = {
    "Gemma 3 270M shape": ("gemma3", 0.6),
    "Gemma 2 2B shape": ("gemma2_2b", 0.65),
    "Llama 3 8B shape": ("llama3_8b", 0.85),
    "Llama 3 8B shape, N = 1024": ("llama3_8b_n1024", 1.0),
    "Phi 3.5 mini shape": ("phi3_5_mini", 1.0),
}
FORWARD_TARGET = 1.15  # one-GEMM times
FORWARD_STEPS = ("vocabulary order", "target logits (indexed dot)", "log-sum-exp forward")
SECOND_RECOMPUTE = "recompute by lists (pass 2 or one pass)"
FIRST_RECOMPUTE = "recompute by grid rows (pass 1)"
REMAINDER = "everything else (PyTorch ops, gaps)"


def bounds(roofline: dict, bench: dict) -> "list[dict]":
    compile_ms = {row["shape"]: row["fwd_bwd_ms"] for row in bench["rows"]
                  if row["method"] == "torch_compile"}
    out = []
    for shape, (bench_shape, limit) in SHAPES.items():
        steps = [row for row in roofline["rows"] if row["shape"] == shape]
        gemm_like = [row for row in steps if "cuBLAS ms, same work" in row]
        summary = next(row for row in roofline["summary"] if row["shape"] == shape)
        # Kernel time where the roofline has one (the order, the target logits, the table); the
        # rest of the call (PyTorch operations and gaps) less what tracing added to the call.
        other_ms = sum(row["kernel ms"] for row in steps
                       if "cuBLAS ms, same work" not in row and row["step"] != REMAINDER)
        tracing_ms = summary["traced fwd+bwd ms"] - summary["fwd+bwd ms"]
        other_ms += max(0.0, next(row["ms"] for row in steps if row["step"] == REMAINDER)
                        - tracing_ms)
        at_cublas = sum(row["cuBLAS ms, same work"] for row in gemm_like)
        measured = sum(row["kernel ms"] for row in gemm_like)
        # With two passes the second recompute repeats pass 1's kept tiles; the one pass has a
        # single recompute already.
        two_passes = any(row["step"] == FIRST_RECOMPUTE for row in steps)
        once = at_cublas - (next(row["cuBLAS ms, same work"] for row in steps
                                 if row["step"] == SECOND_RECOMPUTE) if two_passes else 0.0)
        target_ms = limit * compile_ms[bench_shape]
        lse = next(row for row in steps if row["step"] == "log-sum-exp forward")
        forward_other = sum(row["kernel ms"] for row in steps
                            if row["step"] in FORWARD_STEPS and row is not lse)
        forward_target_ms = FORWARD_TARGET * summary["GEMM ms"]
        out.append({
            "shape": shape, "bench shape": bench_shape,
            "torch.compile ms": compile_ms[bench_shape], "target": limit,
            "target ms": target_ms,
            "other steps ms": other_ms,
            "GEMM-like kernels ms": measured,
            "GEMM-like kernels at cuBLAS ms": at_cublas,
            "fwd+bwd at cuBLAS ms": other_ms + at_cublas,
            "ratio at cuBLAS": (other_ms + at_cublas) / compile_ms[bench_shape],
            "one recompute at cuBLAS ms": other_ms + once,
            "ratio, one recompute at cuBLAS": (other_ms + once) / compile_ms[bench_shape],
            "needed of cuBLAS": at_cublas / (target_ms - other_ms),
            "today of cuBLAS": at_cublas / measured,
            "forward target ms": forward_target_ms,
            "forward at cuBLAS GEMMs": (forward_other + lse["cuBLAS ms, same work"])
            / summary["GEMM ms"],
            "log-sum-exp needed of cuBLAS": lse["cuBLAS ms, same work"]
            / (forward_target_ms - forward_other),
            "log-sum-exp today of cuBLAS": lse["of cuBLAS"],
        })
    return out


def render(rows: "list[dict]", environment: dict) -> str:
    lines = [
        "# fwd+bwd with every GEMM-like kernel at cuBLAS speed",
        "",
        f"From `results/roofline.json` ({environment['device']}, {environment['date']}) and "
        "`results/bench.json` (torch.compile). Other steps as measured: the kernel time of the "
        "order, the target logits and the table, and the rest of the traced call less what "
        "tracing added to it (traced minus untraced fwd+bwd). `needed`: the "
        "fraction of cuBLAS the GEMM-like kernels would need on average to meet the target; "
        "`today`: what they reach.",
        "",
        "| shape | torch.compile ms | target ms | today's kernels, at cuBLAS ms | other steps ms "
        "| fwd+bwd at cuBLAS ms (ratio) | one recompute at cuBLAS ms (ratio) | needed of cuBLAS "
        "| today |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        lines.append(
            f"| {row['shape']} | {row['torch.compile ms']:.1f} | {row['target ms']:.1f} "
            f"({row['target']:g}x) | {row['GEMM-like kernels ms']:.1f}, "
            f"{row['GEMM-like kernels at cuBLAS ms']:.1f} | {row['other steps ms']:.1f} "
            f"| {row['fwd+bwd at cuBLAS ms']:.1f} ({row['ratio at cuBLAS']:.2f}) "
            f"| {row['one recompute at cuBLAS ms']:.1f} "
            f"({row['ratio, one recompute at cuBLAS']:.2f}) "
            f"| {row['needed of cuBLAS']:.2f} | {row['today of cuBLAS']:.2f} |")
    lines += [
        "",
        f"Forward <= {FORWARD_TARGET} one-GEMM times (the roofline's GEMM), with the order's and "
        "the target logits' kernel times as measured:",
        "",
        "| shape | forward target ms | forward at cuBLAS, GEMMs | log-sum-exp needed of cuBLAS "
        "| today |",
        "|---|---|---|---|---|",
    ]
    for row in rows:
        lines.append(
            f"| {row['shape']} | {row['forward target ms']:.2f} "
            f"| {row['forward at cuBLAS GEMMs']:.2f} | {row['log-sum-exp needed of cuBLAS']:.2f} "
            f"| {row['log-sum-exp today of cuBLAS']:.2f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    roofline = json.loads((RESULTS / "roofline.json").read_text())
    bench = json.loads((RESULTS / "bench.json").read_text())
    rows = bounds(roofline, bench)
    environment = {"device": roofline["environment"]["device"],
                   "date": roofline["environment"]["date"]}
    (HERE / "cpu_target_bounds.json").write_text(
        json.dumps({"environment": environment, "rows": rows}, indent=1) + "\n")
    (HERE / "cpu_target_bounds.md").write_text(render(rows, environment))


if __name__ == "__main__":
    main()
