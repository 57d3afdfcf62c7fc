"""The machinery behind gradient filtering and vocabulary sorting, checked against brute force.

The backward skips a tile without recomputing it when the forward's recorded tile maximum and
the LSE prove every softmax entry of the tile is below ``filter_eps``. A tile wrongly marked
dead would silently drop gradient, so the table must be sound: every tile that holds an entry
>= filter_eps, or a target, is live.
"""

from __future__ import annotations

import math

import pytest
import torch

from cce.config import kernel_configs
from cce.lse_forward import lse_forward
from cce.vocab_order import live_tiles, vocab_order

N, V, D = 45, 1500, 40  # not multiples of any block size
EPS = 2.0**-12


def _peaked_inputs(gen: torch.Generator, device: str):
    """Logits with a Zipf-like frequency component, so most tiles hold only tiny entries."""
    e = torch.randn(N, D, generator=gen)
    c = torch.randn(V, D, generator=gen) * (4.0 / math.sqrt(D))
    frequency = -1.5 * torch.log(torch.arange(1, V + 1, dtype=torch.float32))
    c[:, 0] = frequency[torch.randperm(V, generator=gen)]
    e[:, 0] = 3.0
    targets = torch.randint(0, V, (N,), generator=gen)
    targets[::5] = -1  # ignored
    return e.to(device), c.to(device), targets.to(device)


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
    e, c, targets = _peaked_inputs(gen, device)
    bias = torch.randn(V, generator=gen).to(device)
    order = vocab_order(e, c, bias, targets).long()
    average = ((e[targets >= 0].double() @ c.double().T) + bias.double()).mean(dim=0)
    assert sorted(order.tolist()) == list(range(V))
    assert bool((average[order].diff() <= 1e-5).all())


def _forward_tile_max(logits: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """What the forward records for each live-grid tile: the largest entry of the forward tile
    that holds it (forward tiles are whole rows of live-grid tiles)."""
    configs = kernel_configs(dtype)
    grid, forward = configs.live_grid, configs.lse_forward
    maxima = _tile_view(logits, forward.block_tokens, forward.block_vocab).amax(dim=(2, 3))
    live_blocks = -(-logits.shape[1] // grid.block_vocab)
    return maxima.repeat_interleave(forward.block_vocab // grid.block_vocab,
                                    dim=1)[:, :live_blocks]


def test_forward_records_tile_maxima_in_sorted_order(gen: torch.Generator, device: str) -> None:
    """tile_max[i, j] is the largest logit of the forward tile holding tile (i, j) of the live
    grid (a bound on the tile's own largest logit), vocabulary sorted."""
    e, c, targets = _peaked_inputs(gen, device)
    order = vocab_order(e, c, None, targets)
    lse, tile_max = lse_forward(e, c, None, None, targets, order, record_tile_max=True)
    logits = e.double() @ c.double()[order.long()].T
    logits[targets < 0] = -math.inf  # the maxima cover non-ignored tokens only
    torch.testing.assert_close(tile_max.double(), _forward_tile_max(logits, e.dtype),
                               rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse.double(), torch.logsumexp(e.double() @ c.double().T, dim=1),
                               rtol=1e-6, atol=1e-6)


def test_live_tiles_are_sound_and_skip_something(gen: torch.Generator, device: str) -> None:
    """Every tile with a softmax entry >= eps on a row that carries a gradient, or with a
    target, is live; on peaked logits some tiles are dead, so skipping is really exercised."""
    e, c, targets = _peaked_inputs(gen, device)
    order = vocab_order(e, c, None, targets)
    lse, tile_max = lse_forward(e, c, None, None, targets, order, record_tile_max=True)
    grid = kernel_configs(e.dtype).live_grid
    valid = targets >= 0
    live = live_tiles(tile_max, lse, valid.float(), targets, order, grid.block_tokens,
                      grid.block_vocab, EPS)

    sorted_logits = e.double() @ c.double()[order.long()].T
    needed = torch.exp(sorted_logits - lse.double()[:, None])
    needed[~valid] = 0.0
    position = torch.empty_like(order).long()
    position[order.long()] = torch.arange(V, device=order.device)
    needed[valid.nonzero()[:, 0], position[targets[valid]]] = 1.0
    must_be_live = _tile_view(needed, grid.block_tokens, grid.block_vocab).amax(dim=(2, 3)) >= EPS

    assert bool((live[must_be_live] > 0).all()), "a tile with significant entries was skipped"
    assert bool((live == 0).any()), "no tile was dead: the test data is not peaked enough"


@pytest.mark.parametrize("margin, expected_live", [(0.99, True), (1.01, False)])
def test_live_tile_bound_is_exact_for_one_token(gen: torch.Generator, device: str,
                                                margin: float, expected_live: bool) -> None:
    """For a single token the bound exp(tile max - LSE) is the largest probability of the
    forward tile: its live-grid tiles are live just below that threshold, dead just above."""
    e, c, _ = _peaked_inputs(gen, device)
    e, targets = e[:1], torch.zeros(1, dtype=torch.long, device=device)
    lse, tile_max = lse_forward(e, c, None, None, targets, None, record_tile_max=True)
    grid = kernel_configs(e.dtype).live_grid
    probs = torch.exp(e.double() @ c.double().T - lse.double()[:, None])
    tile_probs = _forward_tile_max(probs, e.dtype)[0]
    target_tile = tile_probs == tile_probs[0]  # live anyway: not the tiles under test
    candidates = tile_probs[~target_tile]
    eps = float(candidates.sort().values[candidates.numel() // 2]) * margin  # a middling tile
    tested = (tile_probs * margin == eps) & ~target_tile
    live = live_tiles(tile_max, lse, torch.ones_like(lse), targets, None, grid.block_tokens,
                      grid.block_vocab, eps)
    assert bool(tested.any())
    assert bool(((live[0] > 0) == expected_live)[tested].all())


def _one_token_block_with_one_target(gen: torch.Generator, device: str):
    """One live-grid block of peaked tokens where only the first has a target: (e, c, grid,
    targets, prob_scale with 1 on that token)."""
    e, c, _ = _peaked_inputs(gen, device)
    grid = kernel_configs(e.dtype).live_grid
    e = e[: grid.block_tokens]
    targets = torch.full((e.shape[0],), -1, device=device)
    targets[0] = 0
    return e, c, grid, targets, (targets >= 0).float()


def test_ignored_rows_do_not_keep_tiles_live(gen: torch.Generator, device: str) -> None:
    """Ignored tokens enter neither the recorded maxima nor the bound: the table of a block
    equals that of its one non-ignored token."""
    e, c, grid, targets, scale = _one_token_block_with_one_target(gen, device)
    lse, tile_max = lse_forward(e, c, None, None, targets, None, record_tile_max=True)
    live = live_tiles(tile_max, lse, scale, targets, None, grid.block_tokens, grid.block_vocab,
                      EPS)

    first_lse, first_max = lse_forward(e[:1], c, None, None, targets[:1], None,
                                       record_tile_max=True)
    expected = live_tiles(first_max, first_lse, scale[:1], targets[:1], None, grid.block_tokens,
                          grid.block_vocab, EPS)
    assert torch.equal(live[0] > 0, expected[0] > 0)
    assert bool((live[0] == 0).any()), "the test needs dead tiles"


def test_ignored_row_with_lse_gradient_keeps_its_block_live(gen: torch.Generator,
                                                            device: str) -> None:
    """An ignored token whose LSE carries a gradient is not covered by the maxima, so its
    whole token block stays live."""
    e, c, grid, targets, scale = _one_token_block_with_one_target(gen, device)
    scale[1] = 0.5  # an LSE gradient on an ignored token
    lse, tile_max = lse_forward(e, c, None, None, targets, None, record_tile_max=True)
    live = live_tiles(tile_max, lse, scale, targets, None, grid.block_tokens, grid.block_vocab,
                      EPS)
    assert bool((live[0] > 0).all())


def test_forward_only_calls_prepare_no_backward(gen: torch.Generator, device: str,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """Under torch.no_grad the forward neither sorts the vocabulary nor records tile maxima,
    even when the inputs require gradients; with gradients enabled it does."""
    import cce
    import cce.cce_function

    def must_not_run(*args, **kwargs):
        raise AssertionError("vocab_order ran")

    monkeypatch.setattr(cce.cce_function, "vocab_order", must_not_run)
    e, c, targets = _peaked_inputs(gen, device)
    e.requires_grad_()
    with torch.no_grad():
        cce.linear_cross_entropy(e, c, targets, ignore_index=-1)
    with pytest.raises(AssertionError, match="vocab_order ran"):
        cce.linear_cross_entropy(e, c, targets, ignore_index=-1)
