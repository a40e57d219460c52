import math

import pytest
import torch

from conftest import REPO, parse_config
from torchtitan.config import ConfigManager
from plugin.scoring.loss import build_grpo_loss, grpo_token_terms, kl_penalty
from plugin.job import GRPOJob
from plugin.model.policy import PolicyOutput
from torchtitan.components.loss import IGNORE_INDEX

KL_CLAMP, KL_MAX = 20.0, 10.0  # [grpo] kl_log_ratio_clamp and kl_max defaults, as verl's low_var_kl


def reference_token_loss(lp, old, ref, adv, w, mask, ent, clip_low, clip_high, beta, est, dual=0.0, cap=0.0, ent_coef=0.0):
    """fp64, element by element, straight from the formulas in docs/loss.md."""
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
                d = min(max(lr - l, -KL_CLAMP), KL_CLAMP)
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
                             kl_estimator=est, dual_clip=dual, ratio_cap=cap, entropy_coef=ent_coef,
                             kl_log_ratio_clamp=KL_CLAMP, kl_max=KL_MAX)
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
    k3 = kl_penalty(lp, ref, "k3", log_ratio_clamp=KL_CLAMP, kl_max=KL_MAX)
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
    stats = GRPOJob.of(job).stats  # what the loss records its metrics in
    lp = torch.randn(3, 6).requires_grad_()
    labels = torch.randint(0, 10, (3, 6))
    labels[:, :2] = IGNORE_INDEX
    adv = torch.tensor([1.0, -0.5, 0.25])
    pred = PolicyOutput(lp, torch.ones(3, 6), None, None, adv, torch.tensor([1.0, 0.0, 0.5]), torch.ones(3))
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


def torch_reference_loss(lp, old, ref, adv, w, mask, *, beta, est, ratio_cap, clamp, kl_max, correction,
                         clip_low=0.2, clip_high=0.28):
    """fp64 torch reference, written apart from plugin.scoring.loss: autograd through it gives the expected gradient."""
    raw = torch.exp(lp - old)
    r = torch.minimum(raw, torch.tensor(ratio_cap, dtype=lp.dtype)) if ratio_cap else raw
    a = adv[:, None]
    pg = -torch.minimum(r * a, torch.clamp(r, 1 - clip_low, 1 + clip_high) * a)
    if est == "k1":
        kl = lp - ref
    elif est == "k2":
        kl = (lp - ref) ** 2 / 2
    else:
        d = ref - lp
        if clamp:
            d = torch.where(d.abs() > clamp, d.sign() * clamp, d)  # a constant outside: zero gradient there
        kl = torch.expm1(d) - d
        if kl_max:
            kl = torch.where(kl > kl_max, torch.full_like(kl, kl_max), kl)
    if correction:
        kl = kl * raw  # the untruncated ratio, as TRL's coef_1
    return (pg + beta * kl) * w[:, None] * mask


# l_ref - l per column: the clamp (20) binds at 25 and -30; the cap (10) at 3, 5 and -15 without the clamp binding
LOG_RATIOS = [-30.0, -15.0, -5.0, -0.7, 0.0, 0.4, 1.5, 3.0, 5.0, 25.0]
CAP_ONLY = torch.tensor([False, True, False, False, False, False, False, True, True, False])


@pytest.mark.parametrize("est", ["k1", "k2", "k3"])
@pytest.mark.parametrize("correction", [False, True], ids=["plain", "corrected"])
@pytest.mark.parametrize("clamp", [0.0, KL_CLAMP], ids=["noclamp", "clamp"])
@pytest.mark.parametrize("kl_max", [0.0, KL_MAX], ids=["nocap", "cap"])
def test_kl_options_values_and_gradients_match_torch_reference(est, correction, clamp, kl_max):
    g = torch.Generator().manual_seed(1)
    B, T = 4, len(LOG_RATIOS)
    lp = -torch.rand(B, T, generator=g, dtype=torch.float64) * 2 - 0.1
    ref = lp + torch.tensor(LOG_RATIOS, dtype=torch.float64)
    old = lp + torch.randn(B, T, generator=g, dtype=torch.float64) * 0.5  # ratios above and below the cap
    w = torch.rand(B, generator=g, dtype=torch.float64) + 0.5
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[-1, ::3] = False
    opts = dict(beta=0.3, ratio_cap=1.5)
    kl_opts = dict(kl_estimator=est, kl_log_ratio_clamp=clamp, kl_max=kl_max, bias_correction_kl=correction)
    ref_opts = dict(est=est, clamp=clamp, kl_max=kl_max, correction=correction)

    def grads(adv):
        x, y = lp.clone().requires_grad_(), lp.clone().requires_grad_()
        terms = grpo_token_terms(x, old, ref, adv, w, mask, torch.zeros_like(lp), clip_low=0.2, clip_high=0.28,
                                 **opts, **kl_opts)
        expected = torch_reference_loss(y, old, ref, adv, w, mask, **opts, **ref_opts)
        torch.testing.assert_close(terms.loss, expected, rtol=1e-12, atol=1e-12)
        terms.loss.sum().backward()
        expected.sum().backward()
        # k3's gradient where l_ref - l = 25 is the difference of two terms of ratio * e^25 ~ 1e11: each rounds in
        # its last bit, and which of torch's exp kernels (vectorized or scalar) an element meets depends on its
        # place in memory. Seen once: 7.6e-6 apart at a gradient of 12.9. The slack is 1e-15 of those terms.
        slack = 1e-15 * torch.exp(ref - lp).clamp_min(1) * torch.exp(lp - old).clamp_min(1)
        gap = (x.grad - y.grad).abs()
        assert (gap <= 1e-12 + 1e-12 * y.grad.abs() + slack).all(), gap.max()
        return terms, x.grad

    terms, _ = grads(torch.randn(B, generator=g, dtype=torch.float64))
    plain = torch_reference_loss(lp, lp, ref, torch.zeros(B, dtype=torch.float64), torch.ones(B, dtype=torch.float64),
                                 mask, **dict(opts, beta=1.0), **dict(ref_opts, correction=False))
    torch.testing.assert_close(terms.kl, plain, rtol=1e-12, atol=1e-12)  # grpo/kl: the uncorrected estimate

    # A = 0: the gradient is the KL term's alone
    _, kl_grad = grads(torch.zeros(B, dtype=torch.float64))
    capped = CAP_ONLY.expand(B, T) & mask
    if est != "k3" or not kl_max:
        assert (kl_grad[capped] != 0).all()
    elif correction:  # only the ratio's gradient is left: beta * kl_max * r, lowering l even where pi << pi_ref
        torch.testing.assert_close(kl_grad[capped], (0.3 * KL_MAX * torch.exp(lp - old) * w[:, None])[capped])
    else:
        assert (kl_grad[capped] == 0).all()
    if est == "k3" and clamp and not correction:
        assert (kl_grad[:, [0, -1]] == 0).all()  # past the clamp


def categorical(seed: int, V: int = 7):
    g = torch.Generator().manual_seed(seed)
    return torch.log_softmax(torch.randn(V, generator=g, dtype=torch.float64) * 1.5, -1)


@pytest.mark.parametrize("est, correction, closed_form, on_policy", [
    ("k3", False, "forward", True),  # the GRPO paper's k3: the gradient of KL(pi_ref || pi)
    ("k3", True, "reverse", True),  # DeepSeek-V3.2 / TRL use_bias_correction_kl: that of KL(pi || pi_ref)
    ("k2", False, "reverse", True),
    ("k1", True, "reverse", True),
    ("k1", False, "zero", True),
    ("k3", True, "reverse", False),  # tokens from pi_old: the correction's ratio reweights them to pi
    ("k1", True, "reverse", False),
])
def test_expected_kl_gradient_is_the_closed_form_kl_gradient(est, correction, closed_form, on_policy):
    """E over the sampled token, computed exactly as a sum over a small vocabulary, of the per-token loss's gradient."""
    logits = categorical(0).clone().requires_grad_()
    l = torch.log_softmax(logits, -1)
    l_ref = categorical(1)
    # off-policy: tokens come from pi_old; with behavior_ratio_cap the correction must still use the raw ratio
    l_old = l.detach() if on_policy else categorical(2)
    terms = grpo_token_terms(l[None], l_old[None], l_ref[None], torch.zeros(1, dtype=torch.float64),
                             torch.ones(1, dtype=torch.float64), torch.ones(1, len(l), dtype=torch.bool),
                             torch.zeros(1, len(l), dtype=torch.float64), clip_low=0.2, clip_high=0.2, beta=1.0,
                             kl_estimator=est, ratio_cap=0.0 if on_policy else 1.5, bias_correction_kl=correction)
    expected_loss = (l_old.exp() * terms.loss[0]).sum()
    (grad,) = torch.autograd.grad(expected_loss, logits, retain_graph=True)
    pi, pi_ref = l.exp(), l_ref.exp()
    kl = {"forward": (pi_ref * (l_ref - l)).sum(), "reverse": (pi * (l - l_ref)).sum(), "zero": 0 * l.sum()}
    (want,) = torch.autograd.grad(kl[closed_form], logits)
    assert want.abs().max() > 1e-3 or closed_form == "zero"
    torch.testing.assert_close(grad, want, rtol=1e-10, atol=1e-12)
    if est in ("k1", "k3"):  # unbiased for the value of KL(pi || pi_ref), under pi or, corrected, under pi_old
        assert expected_loss.item() == pytest.approx(kl["reverse"].item(), rel=1e-10)


def test_kl_options_come_from_the_config():
    lp = torch.tensor([[-0.5, -2.0, -1.0, -0.2]], dtype=torch.float64, requires_grad=True)
    ref = lp.detach() + torch.tensor([[30.0, 4.0, -0.5, 0.0]], dtype=torch.float64)
    old = lp.detach() + torch.tensor([[0.3, -0.2, 0.0, float("nan")]], dtype=torch.float64)
    labels = torch.zeros(1, 4, dtype=torch.long)
    adv, ones = torch.tensor([0.5], dtype=torch.float64), torch.ones(1, dtype=torch.float64)
    pred = PolicyOutput(logprobs=lp, entropy=torch.zeros_like(lp), ref_logprobs=ref, old_logprobs=old, advantages=adv,
                        rewards=ones, loss_weights=ones)
    for clamp, cap, correction in [(20.0, 10.0, False), (0.0, 0.0, True), (3.0, 0.0, False), (0.0, 5.0, True)]:
        flags = ["--grpo.use_bias_correction_kl"] if correction else []
        job = parse_config("--grpo.kl_log_ratio_clamp", str(clamp), "--grpo.kl_max", str(cap), *flags)
        got = build_grpo_loss(job)(pred, labels)
        on_policy_old = torch.where(old.isnan(), lp.detach(), old)
        want = torch_reference_loss(lp, on_policy_old, ref, adv, ones, torch.ones_like(lp), beta=job.grpo.beta,
                                    est="k3", ratio_cap=0.0, clamp=clamp, kl_max=cap, correction=correction,
                                    clip_low=0.2, clip_high=0.2).sum()
        assert got.item() == pytest.approx(want.item(), rel=1e-12)


# --- the sequence-level ratio (GSPO) ----------------------------------------------------------------

TRL_FIXTURE = REPO / "tests/fixtures/trl_loss.pt"


@pytest.mark.parametrize("case", range(24))
def test_loss_matches_trls_own_in_the_modes_they_share(case):
    """TRL 1.16's GRPOTrainer._compute_loss, run by tests/fixtures/make_trl_loss_fixture.py: the loss torchtitan
    ends up with (our sum / global completion tokens) and its gradient, token and sequence level, k3 KL."""
    from plugin.data.batch import loss_weights

    fixture = torch.load(TRL_FIXTURE, weights_only=False)
    c = fixture["cases"][case]
    x, o = c["inputs"], c["options"]
    mask = x["mask"].bool()
    lp = x["logprobs"].clone().requires_grad_()
    w = loss_weights(mask.sum(1), c["mode"], fixture["max_len"]).double()
    terms = grpo_token_terms(lp, x["old"], x["ref"], x["adv"], w, mask, torch.zeros_like(lp), clip_low=o["eps_low"],
                             clip_high=o["eps_high"], beta=o["beta"], kl_estimator="k3",
                             importance_sampling_level=o["level"])
    loss = terms.loss.sum() / mask.sum()  # what torchtitan divides by
    loss.backward()
    # loss_weights are float32: the weighted sum agrees with TRL's to float32's precision
    torch.testing.assert_close(loss.detach(), c["loss"], rtol=1e-6, atol=1e-9)
    torch.testing.assert_close(lp.grad, c["grad"], rtol=1e-6, atol=1e-9)
    if o["level"] == "sequence":  # every token of a completion carries its sequence's ratio
        r = terms.ratio.masked_fill(~mask, float("nan"))
        assert torch.allclose(r.nanmean(1, keepdim=True).expand_as(r)[mask], r[mask])


def sequence_reference_loss(lp, old, adv, w, mask, *, clip_low, clip_high, dual, cap):
    """TRL's sequence level (grpo_trainer.py, _compute_loss: exp of the masked mean log-ratio, gradient through the
    mean), with this package's dual clip and ratio cap applied to that ratio; fp64, per token."""
    m = mask.double()
    s = torch.exp(((lp - old) * m).sum(-1) / m.sum(-1).clamp(min=1))[:, None]
    if cap:
        s = torch.minimum(s, torch.tensor(cap, dtype=s.dtype))
    a = adv[:, None]
    pg = -torch.minimum(s * a, torch.clamp(s, 1 - clip_low, 1 + clip_high) * a)
    if dual:
        pg = torch.where(a < 0, torch.minimum(pg, -dual * a), pg)
    return pg * w[:, None] * m


@pytest.mark.parametrize("dual, cap", [(0.0, 0.0), (3.0, 0.0), (0.0, 1.1), (2.0, 1.25)])
def test_sequence_ratio_with_dual_clip_and_cap_matches_the_exact_form(dual, cap):
    g = torch.Generator().manual_seed(3)
    B, T = 8, 13
    lp = -torch.rand(B, T, generator=g, dtype=torch.float64) * 2
    old = lp + torch.randn(B, T, generator=g, dtype=torch.float64) * 0.2 \
        + torch.linspace(-0.5, 0.5, B, dtype=torch.float64)[:, None]  # sequence ratios from 0.6 to 1.6
    adv = torch.randn(B, generator=g, dtype=torch.float64)
    w = torch.rand(B, generator=g, dtype=torch.float64) + 0.5
    mask = torch.rand(B, T, generator=g) > 0.3
    x, y = lp.clone().requires_grad_(), lp.clone().requires_grad_()
    terms = grpo_token_terms(x, old, None, adv, w, mask, torch.zeros_like(lp), clip_low=0.2, clip_high=0.2,
                             beta=0.0, kl_estimator="k3", dual_clip=dual, ratio_cap=cap,
                             importance_sampling_level="sequence")
    want = sequence_reference_loss(y, old, adv, w, mask, clip_low=0.2, clip_high=0.2, dual=dual, cap=cap)
    torch.testing.assert_close(terms.loss, want, rtol=1e-12, atol=1e-12)
    terms.loss.sum().backward()
    want.sum().backward()
    torch.testing.assert_close(x.grad, y.grad, rtol=1e-10, atol=1e-12)
    assert (x.grad != 0).any() and (terms.clipped_low | terms.clipped_high).any()
    # the fused pass hands each chunk the completion's mean log-ratio: any split of the tokens gives the same terms
    m = mask.double()
    seq = ((lp - old) * m).sum(-1) / m.sum(-1).clamp(min=1)
    z = lp.clone().requires_grad_()
    for cols in (slice(0, 5), slice(5, T)):
        part = grpo_token_terms(z[:, cols], old[:, cols], None, adv, w, mask[:, cols], torch.zeros(B, 1), clip_low=0.2,
                                clip_high=0.2, beta=0.0, kl_estimator="k3", dual_clip=dual, ratio_cap=cap,
                                importance_sampling_level="sequence", seq_log_ratio=seq)
        torch.testing.assert_close(part.loss, want[:, cols].detach(), rtol=1e-12, atol=1e-12)
        part.loss.sum().backward()
    torch.testing.assert_close(z.grad, y.grad, rtol=1e-10, atol=1e-12)
