"""The machinery behind gradient filtering and vocabulary sorting, checked against brute force.

The backward skips a tile without recomputing it when the forward's recorded bound proves every
softmax entry of the tile is below ``filter_eps``. A tile wrongly marked dead would silently
drop gradient, so the table must be sound: every tile that holds an entry >= filter_eps, or a
target, is live.
"""

from __future__ import annotations

import math

import pytest
import torch

from cce.config import deterministic_head_blocks, kernel_configs
from cce.forward.indexed_dot import indexed_dot
from cce.forward.lse_forward import leave_out_targets, lse_forward
from cce.backward.live_tiles import live_tiles
from cce.forward.vocab_order import TileMarks, target_positions, vocab_order
from tests.helpers import INTERPRETER_NON_FINITE_WARNINGS, peaked_inputs

N, V, D = 45, 1500, 40  # not multiples of any block size
EPS = 2.0**-12


def _tile_view(matrix: torch.Tensor, block_tokens: int, block_vocab: int) -> torch.Tensor:
    """(token blocks, vocab blocks, block_tokens, block_vocab) view, padded with -inf."""
    rows, cols = matrix.shape
    padded = torch.nn.functional.pad(matrix, (0, (-cols) % block_vocab, 0, (-rows) % block_tokens),
                                     value=-math.inf)
    tiles = padded.view(padded.shape[0] // block_tokens, block_tokens,
                        padded.shape[1] // block_vocab, block_vocab)
    return tiles.permute(0, 2, 1, 3)


def test_vocab_order_sorts_by_average_logit(gen: torch.Generator, device: str) -> None:
    """The order is by decreasing average logit over non-ignored tokens (bias included)."""
    e, c, targets = peaked_inputs(gen, device, N, V, D)
    bias = torch.randn(V, generator=gen).to(device)
    order = vocab_order(e, c, bias, targets).long()
    average = ((e[targets >= 0].double() @ c.double().T) + bias.double()).mean(dim=0)
    assert sorted(order.tolist()) == list(range(V))
    assert bool((average[order].diff() <= 1e-5).all())


@pytest.mark.parametrize("on_cpu", [False, True], ids=["on_device", "on_cpu"])
@pytest.mark.parametrize("sorted_vocabulary", [True, False], ids=["sorted", "unsorted"])
def test_target_positions_place_each_target_in_the_order(sorted_vocabulary: bool, on_cpu: bool,
                                                         gen: torch.Generator,
                                                         device: str) -> None:
    """Each token's target's position in the order (the target itself without sorting), -1
    for ignored tokens, and the tiles of a grid that hold one; sizes past one block of the
    kernels (1024); CPU tensors too, also where the kernels run on a GPU (the experiments'
    tables)."""
    device = "cpu" if on_cpu else device
    num_tokens, vocab_size = 1500, 2500
    block_tokens, block_vocab = 64, 128
    targets = torch.randint(0, vocab_size, (num_tokens,), generator=gen)
    targets[::7] = -1
    order = torch.randperm(vocab_size, generator=gen).to(torch.int32) if sorted_vocabulary else None
    grid_shape = (-(-num_tokens // block_tokens), -(-vocab_size // block_vocab))
    tiles = torch.zeros(grid_shape[0] * grid_shape[1], dtype=torch.int8, device=device)
    positions = target_positions(targets.to(device), None if order is None else order.to(device),
                                 TileMarks(tiles, block_tokens, block_vocab, grid_shape[1])).cpu()
    expected = targets.clone()
    if order is not None:
        position_of = torch.empty(vocab_size, dtype=torch.int64)
        position_of[order.long()] = torch.arange(vocab_size)
        expected = torch.where(targets >= 0, position_of[targets.clamp(min=0)], -1)
    assert positions.dtype == torch.int32
    assert torch.equal(positions.long(), expected)
    held = torch.zeros(grid_shape, dtype=torch.int8)
    rows = torch.arange(num_tokens)[expected >= 0]
    held[rows // block_tokens, expected[expected >= 0] // block_vocab] = 1
    assert torch.equal(tiles.cpu().view(grid_shape), held)


def _per_tile_max(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The largest entry of each live-grid tile."""
    grid = kernel_configs(dtype).live_grid
    return _tile_view(values, grid.block_tokens, grid.block_vocab).amax(dim=(2, 3))


def _forward_with_bounds(e: torch.Tensor, c: torch.Tensor, targets: torch.Tensor,
                         order: "torch.Tensor | None" = None, deterministic: bool = False,
                         leaves_out: bool = False):
    """(lse, tile_bound) as the loss's forward computes them (target logits first); with
    ``leaves_out``, the LSE of each row's other logits, as the loss asks for it."""
    # A permutation's inverse is its argsort.
    position_of = None if order is None else torch.argsort(order).to(torch.int32)
    left_out = leave_out_targets(targets, position_of, e.dtype, c.shape[0]) if leaves_out else None
    target_logit = indexed_dot(e, c, targets, None, None, placement=left_out)
    return lse_forward(e, c, None, None, targets, order, target_logit, left_out=left_out,
                       deterministic=deterministic)


def _rounding(e: torch.Tensor, c: torch.Tensor) -> float:
    """How far a float32 bound may stray from the float64 envelope: a few units in the last
    place of the largest logit (its difference with an LSE of the same size, each rounded)."""
    return 4 * 2.0**-23 * float((e.double() @ c.double().T).abs().max())


def _bound_envelope(e: torch.Tensor, c: torch.Tensor, targets: torch.Tensor,
                    order: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(lowest, highest) value a sound and tight tile bound may take, per live-grid tile, in
    float64: the tile's largest log-probability on a non-ignored row, and its largest logit less
    that row's target logit (the forward knows the target logit before any tile). Both are
    invariant to adding a constant to every logit of a row, and neither depends on the order
    in which the forward's programs merge their partial LSEs."""
    logits = e.double() @ c.double()[order.long()].T
    exact_lse = torch.logsumexp(logits, dim=1)
    ignored = targets < 0
    log_probs = (logits - exact_lse[:, None]).masked_fill(ignored[:, None], -math.inf)
    target_logit = e.double()[~ignored].mul(c.double()[targets[~ignored]]).sum(dim=1)
    above_target = torch.full_like(logits, -math.inf)
    above_target[~ignored] = logits[~ignored] - target_logit[:, None]
    return _per_tile_max(log_probs, e.dtype), _per_tile_max(above_target, e.dtype)


@pytest.mark.parametrize("leaves_out", [False, True], ids=["whole", "target_left_out"])
@pytest.mark.parametrize("deterministic", [False, True], ids=["default", "deterministic"])
def test_forward_records_sound_log_probability_bounds(deterministic: bool, leaves_out: bool,
                                                      gen: torch.Generator, device: str) -> None:
    """tile_bound[i, j] bounds the log-probability of every entry of tile (i, j) of the live
    grid on a non-ignored row (vocabulary sorted), is never above 0, and is at least as tight
    as the target logits alone make it for that tile (not only for the wider forward tile that
    holds it). Also where the LSE leaves the target out, and the lower bound of a row's LSE
    adds up the target's logit and the other logits' LSE."""
    e, c, targets = peaked_inputs(gen, device, N, V, D)
    order = vocab_order(e, c, None, targets)
    lse, tile_bound = _forward_with_bounds(e, c, targets, order, deterministic, leaves_out)
    logits = e.double() @ c.double().T
    if leaves_out:
        rows = torch.nonzero(targets >= 0).squeeze(1)
        logits[rows, targets[rows]] = -math.inf
    # float32 sums in the order the programs merge: a few units in the last place of the
    # largest logit apart from float64 (1e-6 failed once on an H200, at 1.09e-6).
    torch.testing.assert_close(lse.double(), torch.logsumexp(logits, dim=1), rtol=1e-6,
                               atol=_rounding(e, c))

    lowest, highest = _bound_envelope(e, c, targets, order)
    bound = tile_bound.double()
    rounding = _rounding(e, c)
    assert bool((bound >= lowest - rounding).all())
    assert bool((bound <= rounding).all())
    assert bool((bound <= highest + rounding).all())


def test_tile_bounds_ignore_each_rows_logit_offset(gen: torch.Generator, device: str) -> None:
    """Adding a constant to every logit of a row leaves its softmax unchanged, and the bounds
    within the same envelope: rows whose LSE differs a lot do not loosen (or unsoundly
    tighten) each other's bounds. The bounds themselves are not compared between the two calls:
    they read the partial LSEs merged so far, which depends on the programs' schedule."""
    e, c, targets = peaked_inputs(gen, device, N, V, D)
    row_offset = 30.0 * torch.randn(N, 1, generator=gen).to(device)
    shifted_e = torch.cat([e, row_offset], dim=1)
    shifted_c = torch.cat([c, torch.ones(V, 1, device=device)], dim=1)
    order = vocab_order(e, c, None, targets)
    lowest, highest = _bound_envelope(e, c, targets, order)
    for inputs in ((e, c), (shifted_e, shifted_c)):
        _, tile_bound = _forward_with_bounds(*inputs, targets, order)
        bound = tile_bound.double()
        assert bool((bound >= lowest - 1e-3).all())
        assert bool((bound <= highest.clamp(max=0.0) + 1e-3).all())
        assert bool((tile_bound < math.log(EPS)).any()), "the test needs tiles proven dead"


def test_deterministic_bounds_rest_on_the_head_of_the_order(gen: torch.Generator,
                                                           device: str) -> None:
    """In deterministic mode no program reads what others have merged, which would make the
    bounds depend on the schedule: the head of the order runs first, and the bound of every
    later tile is at least as tight as the head's LSE makes it."""
    configs = kernel_configs(torch.float32)  # peaked_inputs' dtype
    block_vocab = configs.lse_forward.block_vocab
    # Room for forward tiles after the head, which on a GPU is longer than V.
    vocab = max(V, block_vocab * (deterministic_head_blocks(2**20) + 4) + 3)
    e, c, targets = peaked_inputs(gen, device, N, vocab, D)
    order = vocab_order(e, c, None, targets)
    _, tile_bound = _forward_with_bounds(e, c, targets, order, deterministic=True)
    head = deterministic_head_blocks(-(-vocab // block_vocab)) * block_vocab
    logits = e.double() @ c.double()[order.long()].T
    above_head = logits - torch.logsumexp(logits[:, :head], dim=1, keepdim=True)
    head_made = _per_tile_max(above_head.masked_fill((targets < 0)[:, None], -math.inf), e.dtype)
    lowest, highest = _bound_envelope(e, c, targets, order)
    later = head // configs.live_grid.block_vocab
    bound = tile_bound.double()
    assert 0 < later < bound.shape[1]
    assert bool((bound >= lowest - _rounding(e, c)).all())
    assert bool((bound[:, later:] <= head_made[:, later:] + 1e-4).all())
    assert bool((bound[:, later:] < highest[:, later:] - 1e-2).any()), "the head tightens none"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_deterministic_bounds_do_not_depend_on_the_schedule(gen: torch.Generator) -> None:
    """With other work on the GPU the forward's programs run in another order; the default's
    bounds read what others have merged so far, deterministic mode's do not, so they and the
    backward's plan from them stay the same."""
    n, v, d = 8192, 64000, 1024
    e = (3 * torch.randn(n, d, generator=gen)).to("cuda", torch.bfloat16)
    c = (torch.randn(v, d, generator=gen) / d**0.5).to("cuda", torch.bfloat16)
    targets = torch.randint(0, v, (n,), generator=gen).cuda()
    order = vocab_order(e, c, None, targets)
    expected = _forward_with_bounds(e, c, targets, order, deterministic=True)[1]
    load = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    for _ in range(5):
        with torch.cuda.stream(side):
            for _ in range(4):
                load @ load
        tile_bound = _forward_with_bounds(e, c, targets, order, deterministic=True)[1]
        assert torch.equal(tile_bound, expected)
    torch.cuda.synchronize()


def test_each_live_grid_tile_gets_its_own_bound(gen: torch.Generator, device: str) -> None:
    """A forward tile spans two live-grid tiles (16-bit inputs) and each gets the bound of its
    own entries: here every target sits in the first, with logits far above all others, so
    the second, in the same forward tile, is proven dead (one bound per forward tile would
    keep it live)."""
    configs = kernel_configs(torch.bfloat16)
    grid, forward = configs.live_grid, configs.lse_forward
    assert forward.block_vocab == 2 * grid.block_vocab
    num_tokens, vocab, dim = 2 * grid.block_tokens - 3, 3 * forward.block_vocab - 7, 8
    c = 0.01 * torch.randn(vocab, dim, generator=gen)
    c[:grid.block_vocab, 0] = 10.0
    e = torch.zeros(num_tokens, dim)
    e[:, 0] = 2.0  # logits: 20 in the first live-grid tile, about 0 elsewhere
    targets = torch.randint(0, grid.block_vocab, (num_tokens,), generator=gen)
    e, c, targets = e.to(device, torch.bfloat16), c.to(device, torch.bfloat16), targets.to(device)
    _, tile_bound = _forward_with_bounds(e, c, targets)
    assert bool((tile_bound[:, 0] >= math.log(EPS)).all())
    assert bool((tile_bound[:, 1:] < math.log(EPS)).all())


def test_live_tiles_are_sound_and_skip_something(gen: torch.Generator, device: str) -> None:
    """Every tile with a softmax entry >= eps on a row that carries a gradient, or with a
    target, is live; on peaked logits some tiles are dead, so skipping is really exercised."""
    e, c, targets = peaked_inputs(gen, device, N, V, D)
    order = vocab_order(e, c, None, targets)
    lse, tile_bound = _forward_with_bounds(e, c, targets, order)
    grid = kernel_configs(e.dtype).live_grid
    valid = targets >= 0
    live = live_tiles(tile_bound, lse, valid.float(), target_positions(targets, order),
                      grid.block_tokens, grid.block_vocab, EPS)

    sorted_logits = e.double() @ c.double()[order.long()].T
    needed = torch.exp(sorted_logits - lse.double()[:, None])
    needed[~valid] = 0.0
    position = torch.empty_like(order).long()
    position[order.long()] = torch.arange(V, device=order.device)
    needed[valid.nonzero()[:, 0], position[targets[valid]]] = 1.0
    must_be_live = _per_tile_max(needed, e.dtype) >= EPS

    assert bool((live[must_be_live] > 0).all()), "a tile with significant entries was skipped"
    assert bool((live == 0).any()), "no tile was dead: the test data is not peaked enough"


@INTERPRETER_NON_FINITE_WARNINGS
def test_live_tiles_table_is_the_bounds_verdict(gen: torch.Generator, device: str) -> None:
    """1 exactly where the bound is not below log(eps) (NaN included), the tile holds a target,
    or the token block has a row the bounds do not cover (an ignored row with a gradient, or an
    LSE that is NaN or infinite); 0 elsewhere. Bounds around the threshold, partial last token
    block, a bound table that is a view of part of a wider one."""
    block_tokens, block_vocab = 4, 8
    num_tokens, num_vocab_blocks = 5 * block_tokens - 1, 37
    log_eps = math.log(EPS)
    bound = log_eps + torch.randn(5, num_vocab_blocks, generator=gen, dtype=torch.float64)
    bound = bound.float()
    bound[4, 3] = float("nan")
    bound[1, :5] = log_eps  # exactly at the threshold: live
    positions = torch.randint(0, num_vocab_blocks * block_vocab, (num_tokens,), generator=gen,
                              dtype=torch.int32)
    positions[:5] = -1  # ignored tokens, in blocks 0 and 1
    scale = (positions >= 0).float()
    scale[5] = 0.0  # a target but no gradient: its tile is live all the same
    scale[1] = 0.5  # ignored with a gradient (through the LSE): block 0 is not covered
    lse = torch.zeros(num_tokens)
    lse[9] = float("nan")  # block 2 is not covered
    lse[13] = float("inf")  # nor is block 3 (an infinite logit)

    expected = bound >= torch.tensor(log_eps, dtype=torch.float32)  # compared in float32
    expected |= bound.isnan()
    expected[[0, 2, 3]] = True
    for token in range(num_tokens):
        if positions[token] >= 0:
            expected[token // block_tokens, positions[token] // block_vocab] = True
    wider = torch.full((5, num_vocab_blocks + 3), float("nan"))  # a view of part of the rows
    wider[:, :num_vocab_blocks] = bound
    live = live_tiles(wider.to(device)[:, :num_vocab_blocks], lse.to(device), scale.to(device),
                      positions.to(device), block_tokens, block_vocab, EPS)
    assert live.dtype == torch.int32
    assert torch.equal(live.cpu(), expected.to(torch.int32))
    assert 0 < int(live[4].sum()) < num_vocab_blocks, "the test needs live and dead tiles"


def _one_token_block_with_one_target(gen: torch.Generator, device: str):
    """One live-grid block of peaked tokens where only the first has a target: (e, c, grid,
    targets, prob_scale with 1 on that token)."""
    e, c, _ = peaked_inputs(gen, device, N, V, D)
    grid = kernel_configs(e.dtype).live_grid
    e = e[: grid.block_tokens]
    targets = torch.full((e.shape[0],), -1, device=device)
    targets[0] = 0
    return e, c, grid, targets, (targets >= 0).float()


def test_ignored_rows_do_not_keep_tiles_live(gen: torch.Generator, device: str) -> None:
    """Ignored tokens do not enter the recorded bounds: the table of a block equals that of its
    one non-ignored token."""
    e, c, grid, targets, scale = _one_token_block_with_one_target(gen, device)
    lse, tile_bound = _forward_with_bounds(e, c, targets)
    live = live_tiles(tile_bound, lse, scale, target_positions(targets, None),
                      grid.block_tokens, grid.block_vocab, EPS)

    first_lse, first_bound = _forward_with_bounds(e[:1], c, targets[:1])
    expected = live_tiles(first_bound, first_lse, scale[:1],
                          target_positions(targets[:1], None), grid.block_tokens,
                          grid.block_vocab, EPS)
    assert torch.equal(live[0] > 0, expected[0] > 0)
    assert bool((live[0] == 0).any()), "the test needs dead tiles"


def test_ignored_row_with_lse_gradient_keeps_its_block_live(gen: torch.Generator,
                                                            device: str) -> None:
    """An ignored token whose LSE carries a gradient is not covered by the bounds, so its
    whole token block stays live."""
    e, c, grid, targets, scale = _one_token_block_with_one_target(gen, device)
    scale[1] = 0.5  # an LSE gradient on an ignored token
    lse, tile_bound = _forward_with_bounds(e, c, targets)
    live = live_tiles(tile_bound, lse, scale, target_positions(targets, None),
                      grid.block_tokens, grid.block_vocab, EPS)
    assert bool((live[0] > 0).all())


def test_forward_only_calls_prepare_no_backward(gen: torch.Generator, device: str) -> None:
    """Under torch.no_grad the forward neither sorts the vocabulary nor records tile bounds,
    even when the inputs require gradients; with gradients enabled it does."""
    import cce
    from cce.forward.plan import forced

    e, c, targets = peaked_inputs(gen, device, N, V, D)
    e.requires_grad_()
    with forced() as plans:
        with torch.no_grad():
            cce.linear_cross_entropy(e, c, targets, ignore_index=-1)
        cce.linear_cross_entropy(e, c, targets, ignore_index=-1)
    assert [(plan.sorts, plan.records_bounds) for plan in plans] == [(False, False),
                                                                      (True, True)]


def test_a_training_call_reads_c_once_for_the_order_and_the_mean_row(
        gen: torch.Generator, device: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The vocabulary order's average logits and the mass correction's mean row of c come from
    one read of c, in the forward; without sorting, the backward reads c for the mean row."""
    import cce
    from cce.forward import classifier_sums

    calls = []
    read_c = classifier_sums.classifier_sums

    def counted(*args, **kwargs):
        calls.append(len(args) + len(kwargs))
        return read_c(*args, **kwargs)

    monkeypatch.setattr(classifier_sums, "classifier_sums", counted)
    e, c, targets = peaked_inputs(gen, device, N, V, D)
    e.requires_grad_()
    c.requires_grad_()
    cce.linear_cross_entropy(e, c, targets, ignore_index=-1).backward()
    assert calls == [2]  # c and the mean embedding, once
    calls.clear()
    cce.linear_cross_entropy(e, c, targets, ignore_index=-1, vocab_sorting=False).backward()
    assert calls == [1]  # c alone, in the backward


def test_forward_copies_c_in_position_order_only_into_memory_the_backward_takes(
        gen: torch.Generator, device: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """With sorting, the forward's tile products read c by tensor descriptor from a copy of c in
    position order, made only where the backward takes as much memory anyway: when dC follows,
    or, with a frozen classifier, when there are at least D tokens (the dE-only backward's
    buffer is then as large as c). Otherwise the rows are gathered through the order; without
    sorting (no backward) c is read as it is. Loss and gradients are the gathering forward's,
    to the bit."""
    import cce
    import cce.forward.lse_forward
    from cce.forward.plan import forced

    e, c, targets = peaked_inputs(gen, device, N, V, D)
    e, c = e.bfloat16(), c.bfloat16()
    if not cce.forward.lse_forward._descriptor_ready(e):
        pytest.skip("tensor descriptors need a Hopper GPU or the interpreter")
    read = []
    by_position = cce.forward.lse_forward.classifier_by_position

    def spy(e_, c_, order, copy):
        rows = by_position(e_, c_, order, copy)
        read.append("gather" if rows is None else "c" if rows is c_ else "copy")
        return rows

    monkeypatch.setattr(cce.forward.lse_forward, "classifier_by_position", spy)

    def loss_and_gradients(tokens: int = N, frozen_c: bool = False):
        e_, c_ = e[:tokens].clone().requires_grad_(), c.clone().requires_grad_(not frozen_c)
        loss = cce.linear_cross_entropy(e_, c_, targets[:tokens], ignore_index=-1,
                                        deterministic=True)
        loss.backward()
        return loss, e_.grad, c_.grad

    with forced(copy_min_tokens=0):  # small N on a GPU too
        copied = loss_and_gradients()
        loss_and_gradients(frozen_c=True)
        loss_and_gradients(tokens=D - 1, frozen_c=True)
        with torch.no_grad():
            cce.linear_cross_entropy(e, c, targets, ignore_index=-1)
    assert read == ["copy", "copy", "gather", "c"]
    with forced(copies_classifier=False):
        gathered = loss_and_gradients()
    assert read[-1] == "gather"
    for by_copy, by_gather in zip(copied, gathered):
        assert torch.equal(by_copy, by_gather)
