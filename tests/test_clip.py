"""The one global-norm clipping rule (``chimera.runtime.clip``) every runner uses."""

import math

import pytest
import torch

from chimera.runtime.clip import clip_by_global_norm_, sum_of_squares


def grads(seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(7, 3, generator=g, dtype=torch.float64), torch.randn(5, generator=g, dtype=torch.float64)]


@pytest.mark.parametrize("max_norm", [0.3, 1.0, 100.0])
def test_the_rule_is_torchs(max_norm):
    ours, theirs = grads(), [torch.nn.Parameter(t.clone()) for t in grads()]
    for p, t in zip(theirs, grads()):
        p.grad = t.clone()
    norm = clip_by_global_norm_(ours, sum_of_squares(ours), max_norm)
    expected = torch.nn.utils.clip_grad_norm_(theirs, max_norm)
    assert float(norm) == pytest.approx(float(expected), rel=1e-15)
    for a, p in zip(ours, theirs):
        torch.testing.assert_close(a, p.grad, rtol=1e-15, atol=0)
    assert float(sum_of_squares(ours).sqrt()) == pytest.approx(min(max_norm, float(norm)), rel=1e-5)


def test_shares_are_summed_and_nothing_is_clipped_below_the_limit_or_when_not_finite():
    g = grads()
    whole = float(sum_of_squares(g).sqrt())
    halves = []
    norm = clip_by_global_norm_(g, sum_of_squares(g[:1]), max_norm=None,
                                all_reduce=lambda t: (halves.append(t), t.add_(sum_of_squares(g[1:]))))
    assert float(norm) == pytest.approx(whole, rel=1e-15) and len(halves) == 1
    assert all(torch.equal(a, b) for a, b in zip(g, grads()))  # None: measured, not clipped
    clip_by_global_norm_(g, sum_of_squares(g), whole)  # at the limit: unchanged
    assert all(torch.equal(a, b) for a, b in zip(g, grads()))
    g[0][0, 0] = math.inf
    assert math.isinf(float(clip_by_global_norm_(g, sum_of_squares(g), 0.1)))
    assert torch.equal(g[1], grads()[1])  # a non-finite norm scales nothing
    assert float(clip_by_global_norm_([], sum_of_squares([]), 1.0)) == 0.0
