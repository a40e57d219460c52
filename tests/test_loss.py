import math

import pytest
import torch

from conftest import REPO
from torchtitan.config import ConfigManager
from plugin.loss import KL_MAX, build_grpo_loss, grpo_token_terms, kl_penalty
from plugin.metrics import GRPOStats
from plugin.model import PolicyOutput
from torchtitan.components.loss import IGNORE_INDEX


def reference_token_loss(lp, old, ref, adv, w, mask, ent, clip_low, clip_high, beta, est, dual=0.0, cap=0.0, ent_coef=0.0):
    """fp64, element by element, straight from the formulas in grpo-reference.md."""
    out = torch.zeros_like(lp, dtype=torch.float64)
    B, T = lp.shape
    for b in range(B):
        for t in range(T):
            if not mask[b, t]:
                continue
            l, lo, lr, a = float(lp[b, t]), float(old[b, t]), float(ref[b, t]), float(adv[b])
            r = math.exp(l - lo)
            if cap:
                r = min(r, cap)
            pg = -min(r * a, min(max(r, 1 - clip_low), 1 + clip_high) * a)
            if dual and a < 0:
                pg = min(pg, -dual * a)
            if est == "k1":
                kl = l - lr
            elif est == "k2":
                kl = 0.5 * (l - lr) ** 2
            else:
                d = min(max(lr - l, -20.0), 20.0)
                kl = min(math.exp(d) - d - 1, KL_MAX)
            out[b, t] = (pg + beta * kl - ent_coef * float(ent[b, t])) * float(w[b])
    return out


OPTIONS = [
    dict(clip_low=0.2, clip_high=0.2, beta=0.04),
    dict(clip_low=0.1, clip_high=0.28, beta=0.0),
    dict(clip_low=0.2, clip_high=0.2, beta=1.0, dual=3.0),
    dict(clip_low=0.2, clip_high=0.2, beta=0.04, cap=1.5),
    dict(clip_low=0.2, clip_high=0.2, beta=0.04, dual=2.0, cap=2.0, ent_coef=0.01),
]


@pytest.mark.parametrize("est", ["k1", "k2", "k3"])
@pytest.mark.parametrize("opts", OPTIONS, ids=lambda o: "-".join(f"{k}{v}" for k, v in o.items()))
def test_token_terms_match_reference(est, opts):
    g = torch.Generator().manual_seed(0)
    B, T = 5, 47
    lp = (-torch.rand(B, T, generator=g, dtype=torch.float64) * 3).requires_grad_()
    old = lp.detach() + torch.randn(B, T, generator=g, dtype=torch.float64) * 0.3  # off-policy: ratios != 1
    ref = lp.detach() + torch.randn(B, T, generator=g, dtype=torch.float64) * 0.5
    adv = torch.randn(B, generator=g, dtype=torch.float64)
    w = torch.rand(B, generator=g, dtype=torch.float64) + 0.5
    ent = torch.rand(B, T, generator=g, dtype=torch.float64) * 5
    mask = torch.rand(B, T, generator=g) > 0.3
    clip_low, clip_high, beta = opts["clip_low"], opts["clip_high"], opts["beta"]
    dual, cap, ent_coef = opts.get("dual", 0.0), opts.get("cap", 0.0), opts.get("ent_coef", 0.0)
    terms = grpo_token_terms(lp, old, ref, adv, w, mask, ent, clip_low=clip_low, clip_high=clip_high, beta=beta,
                             kl_estimator=est, dual_clip=dual, ratio_cap=cap, entropy_coef=ent_coef)
    ref_args = (old, ref, adv, w, mask, ent, clip_low, clip_high, beta, est, dual, cap, ent_coef)
    expected = reference_token_loss(lp.detach(), *ref_args)
    torch.testing.assert_close(terms.loss.detach(), expected, rtol=1e-10, atol=1e-12)

    # gradient by finite differences of the reference, at a few masked-in positions
    terms.loss.sum().backward()
    eps = 1e-6
    for b, t in mask.nonzero()[:6].tolist():
        bumped = lp.detach().clone()
        bumped[b, t] += eps
        up = reference_token_loss(bumped, *ref_args).sum()
        bumped[b, t] -= 2 * eps
        down = reference_token_loss(bumped, *ref_args).sum()
        assert lp.grad[b, t].item() == pytest.approx(((up - down) / (2 * eps)).item(), rel=1e-4, abs=1e-7)
    assert lp.grad[~mask].eq(0).all()

    ratio = torch.exp(lp.detach() - old)
    if cap:
        ratio = ratio.clamp(max=cap)
    assert torch.equal(terms.clipped_low, (ratio < 1 - clip_low) & (adv[:, None] < 0) & mask)
    assert torch.equal(terms.clipped_high, (ratio > 1 + clip_high) & (adv[:, None] > 0) & mask)


def test_k3_is_nonnegative_zero_at_equality_and_clamped():
    lp = torch.tensor([-1.0, -2.0, -0.5, -30.0])
    ref = torch.tensor([-1.0, -0.1, -3.0, -0.0])
    k3 = kl_penalty(lp, ref, "k3")
    assert k3[0] == 0
    assert (k3 >= 0).all()
    assert k3[3] == KL_MAX  # exp(20) - 21 would be ~5e8
    # k3 uses pi_ref / pi: with d = ref - lp, exp(d) - d - 1
    d = ref[1] - lp[1]
    assert k3[1].item() == pytest.approx((d.exp() - d - 1).item())


def test_on_policy_loss_sum_and_gradient():
    """On-policy (old = lp.detach()): loss = -sum(A * mask) and d/dlp = -A * mask, plus beta * k3 terms."""
    job = ConfigManager().parse_args(["--job.config_file", str(REPO / "train_configs/debug_cpu.toml"), "--grpo.beta", "0"])
    loss_fn = build_grpo_loss(job)
    lp = torch.randn(3, 6).requires_grad_()
    labels = torch.randint(0, 10, (3, 6))
    labels[:, :2] = IGNORE_INDEX
    adv = torch.tensor([1.0, -0.5, 0.25])
    stats = GRPOStats()
    pred = PolicyOutput(lp, torch.ones(3, 6), None, None, adv, torch.tensor([1.0, 0.0, 0.5]), torch.ones(3), stats)
    loss = loss_fn(pred, labels)
    mask = (labels != IGNORE_INDEX).float()
    assert loss.item() == pytest.approx(-(adv[:, None] * mask).sum().item())
    loss.backward()
    torch.testing.assert_close(lp.grad, -adv[:, None] * mask)
    m = stats.reduce(None, torch.device("cpu"))
    assert m["grpo/ratio_mean"] == pytest.approx(1.0)
    assert m["grpo/clip_fraction"] == 0
    assert m["grpo/entropy"] == pytest.approx(1.0)
    assert m["grpo/reward_mean"] == pytest.approx(0.5)
    assert m["grpo/reward_std"] == pytest.approx(torch.tensor([1.0, 0.0, 0.5]).std(unbiased=False).item())
    assert m["grpo/completion_length_mean"] == pytest.approx(4.0)
    assert m["grpo/advantage_mean"] == pytest.approx(adv.mean().item())
