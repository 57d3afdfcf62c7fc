"""Would the recompute run faster per FLOP with the forward's tile shape? (probe, GPU)

The recompute (``cce.gradient_tiles``) computes one 128 x 128 tile per program at 45-73% of
cuBLAS (H100 roofline, 2026-11-26), while the forward's gathered 128 x 256 tiles ran at 65-81%
(docs/notes/forward.md). A recompute program could take two live tiles of one token block (any
two: their rows of c are gathered anyway) as one 128 x 256 tile, or two listed token blocks of
one vocabulary block as one 256 x 128 tile. This times the recompute kernel itself with those
tile shapes, before any such pairing is written: every tile of a chunk of token blocks (pass 1's
layout, a buffer of its own), the filter on with a threshold of 0 (every tile kept and stored),
rows of c gathered through a random order, against cuBLAS's ``e[chunk] @ c.T`` on the same work.

Each variant swaps the live grid's tile and the recompute's warps and stages
(``cce.gradient_tiles.kernel_configs``); the kernel source is cce's. Three alternating rounds,
CUDA events, median of 10 calls after 3 warm-up calls.

``python results/dev/h100_recompute_tile_shape.py OUT_DIR`` writes
``h100_recompute_tile_shape.json``.
"""

import contextlib
import dataclasses
import functools
import json
import statistics
import sys
from pathlib import Path

import torch

import cce.gradient_tiles as gradient_tiles_module
from cce.config import KernelConfig, kernel_configs
from cce.scratch import Scratch
from experiments.harness import environment, time_fn

SHAPES = {"gemma3": (262144, 640), "gemma2_2b": (256000, 2304), "llama3_8b": (128256, 4096),
          "phi3_5_mini": (32064, 3072)}
CHUNK_TOKENS = 2048
# name -> (grid block_tokens, grid block_vocab, block_dim, warps, stages)
VARIANTS = {
    "128x128 w4 s3 (today)": (128, 128, 64, 4, 3),
    "128x256 w8 s3": (128, 256, 64, 8, 3),
    "128x256 w8 s2": (128, 256, 64, 8, 2),
    "128x256 w4 s3": (128, 256, 64, 4, 3),
    "256x128 w8 s3": (256, 128, 64, 8, 3),
    "256x128 w8 s2": (256, 128, 64, 8, 2),
}
ROUNDS, WARMUP, CALLS = 3, 3, 10


def configs_for(variant: tuple) -> object:
    block_tokens, block_vocab, block_dim, warps, stages = variant
    base = kernel_configs(torch.bfloat16)
    return dataclasses.replace(
        base,
        lse_forward=dataclasses.replace(base.lse_forward, block_tokens=block_tokens,
                                        block_vocab=block_vocab),
        live_grid=KernelConfig(block_tokens=block_tokens, block_vocab=block_vocab),
        gradient_tiles=KernelConfig(block_dim=block_dim, num_warps=warps, num_stages=stages))


@contextlib.contextmanager
def recompute_with(configs: object):
    """``cce.gradient_tiles`` launching with ``configs`` while entered."""
    original = gradient_tiles_module.kernel_configs
    gradient_tiles_module.kernel_configs = lambda dtype: configs
    try:
        yield
    finally:
        gradient_tiles_module.kernel_configs = original


def recompute_call(inputs: dict, configs: object):
    grid = configs.live_grid
    e, c = inputs["e"], inputs["c"]
    vocab_size = c.shape[0]
    num_vocab_blocks = -(-vocab_size // grid.block_vocab)
    token_blocks = range(0, CHUNK_TOKENS // grid.block_tokens)
    flags = torch.zeros((e.shape[0] // grid.block_tokens, num_vocab_blocks), dtype=torch.int32,
                        device=e.device)
    scratch = Scratch.dedicated(CHUNK_TOKENS * num_vocab_blocks, grid.block_vocab, e.dtype,
                                e.device)

    def call():
        recompute = gradient_tiles_module.RecomputeInputs(
            e, c, inputs["positions"], None, None, inputs["lse"], inputs["prob_scale"],
            inputs["target_scale"], inputs["order"], 0.0, None)
        gradient_tiles_module.gradient_tiles(recompute, None, flags, scratch, token_blocks,
                                             range(num_vocab_blocks))
    return call


def main(out_dir: Path) -> None:
    results = {"environment": environment(), "chunk_tokens": CHUNK_TOKENS, "variants": {},
               "what": __doc__.splitlines()[0]}
    for name, (vocab_size, dim) in SHAPES.items():
        generator = torch.Generator(device="cuda").manual_seed(0)
        n = 4 * CHUNK_TOKENS
        e = (torch.randn((n, dim), device="cuda", generator=generator) / dim**0.5
             ).to(torch.bfloat16)
        c = torch.randn((vocab_size, dim), device="cuda", generator=generator
                        ).to(torch.bfloat16)
        order = torch.randperm(vocab_size, device="cuda", generator=generator).to(torch.int32)
        inputs = {"e": e, "c": c, "order": order,
                  "positions": torch.randint(0, vocab_size, (n,), device="cuda",
                                             generator=generator),
                  "lse": torch.full((n,), 20.0, device="cuda"),
                  "prob_scale": torch.full((n,), 1.0 / n, device="cuda"),
                  "target_scale": torch.full((n,), 1.0 / n, device="cuda")}
        flops = 2.0 * CHUNK_TOKENS * vocab_size * dim
        rows = {variant: [] for variant in VARIANTS}
        cublas = []
        for _ in range(ROUNDS):
            cublas.append(time_fn(functools.partial(torch.mm, e[:CHUNK_TOKENS], c.T),
                                  warmup=WARMUP, repeats=CALLS))
            for variant, settings in VARIANTS.items():
                configs = configs_for(settings)
                with recompute_with(configs):
                    rows[variant].append(time_fn(recompute_call(inputs, configs),
                                                 warmup=WARMUP, repeats=CALLS))
        cublas_ms = statistics.median(cublas)
        results["variants"][name] = {
            "cuBLAS ms": cublas, "cuBLAS TFLOP/s": flops / cublas_ms / 1e9,
            "recompute ms": rows,
            "recompute TFLOP/s": {v: flops / statistics.median(t) / 1e9 for v, t in rows.items()},
            "of cuBLAS": {v: cublas_ms / statistics.median(t) for v, t in rows.items()},
        }
        print(name, {v: round(r, 3) for v, r in results["variants"][name]["of cuBLAS"].items()},
              flush=True)
        del e, c, inputs
        torch.cuda.empty_cache()
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "h100_recompute_tile_shape.json").write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
