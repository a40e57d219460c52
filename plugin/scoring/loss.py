"""GRPO loss: clipped-ratio policy term plus beta * KL to the reference, per completion token.

It keeps torchtitan's loss contract: the loss function returns a SUM over valid tokens and the
trainer divides by the global number of valid (non-IGNORE_INDEX) tokens, which is token_mean.
"""

from contextlib import nullcontext
from dataclasses import dataclass
from functools import partial

import torch
from torchtitan.components.loss import IGNORE_INDEX
from torchtitan.tools.logging import logger

from plugin.config import compiles_loss
from plugin.job import GRPOJob
from plugin.scoring.logprobs import maybe_compiled


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str, *,
               log_ratio_clamp: float, kl_max: float) -> torch.Tensor:
    """Per-token KL(pi || pi_ref) estimate from sampled-token log-probs; k3's clamp and cap are off at 0."""
    if estimator == "k1":
        return logprobs - ref_logprobs
    if estimator == "k2":
        return 0.5 * (logprobs - ref_logprobs) ** 2
    # k3 needs pi_ref / pi (not pi / pi_ref) to be an unbiased, non-negative estimate on-policy
    d = ref_logprobs - logprobs
    if log_ratio_clamp > 0:
        # exp overflows fp32 past 88, and exp(20) ~ 5e8 already dwarfs any useful penalty
        d = d.clamp(-log_ratio_clamp, log_ratio_clamp)
    k3 = d.exp() - d - 1
    # verl's low_var_kl cap (TRL has none): one outlier token cannot dominate the batch, but gets no KL gradient
    return k3.clamp(max=kl_max) if kl_max > 0 else k3


@dataclass
class TokenTerms:
    loss: torch.Tensor  # [B, T] per-token loss, zero outside the mask
    kl: torch.Tensor  # [B, T] detached
    ratio: torch.Tensor  # [B, T] detached
    clipped_low: torch.Tensor  # [B, T] bool: ratio < 1 - clip_low and A < 0 (the clip is active)
    clipped_high: torch.Tensor  # [B, T] bool: ratio > 1 + clip_high and A > 0


def grpo_token_terms(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor | None,
    advantages: torch.Tensor,
    weights: torch.Tensor,
    mask: torch.Tensor,
    entropy: torch.Tensor,
    *,
    clip_low: float,
    clip_high: float,
    beta: float,
    kl_estimator: str,
    dual_clip: float = 0.0,
    ratio_cap: float = 0.0,
    entropy_coef: float = 0.0,
    kl_log_ratio_clamp: float = 0.0,
    kl_max: float = 0.0,
    bias_correction_kl: bool = False,
    importance_sampling_level: str = "token",
    seq_log_ratio: torch.Tensor | None = None,
) -> TokenTerms:
    """Per-token GRPO terms; `advantages` and `weights` are [B] (one per completion), the rest [B, T].

    At the "sequence" level (GSPO) a completion's ratio is exp(mean over its masked tokens of l - l_old).
    `seq_log_ratio` [B] gives that mean where the rows are pieces of completions (the fused pass's
    chunks); None computes it from these [B, T] rows.
    """
    adv = advantages.to(logprobs.dtype)[:, None]  # [B, 1]
    log_ratio = logprobs - old_logprobs
    if importance_sampling_level == "sequence":
        if seq_log_ratio is None:
            m = mask.to(logprobs.dtype)
            seq_log_ratio = (log_ratio.detach() * m).sum(-1) / m.sum(-1).clamp(min=1)
        # GSPO-token's form: the sequence's value, and d ratio / d l_t = ratio on every token t. Each token of a
        # completion has the same weight and advantage, so the gradient summed over them is that of
        # exp(mean(l - l_old)) (TRL's form, tests/test_loss.py), and each token's term needs no other token
        log_ratio = seq_log_ratio.to(logprobs.dtype)[:, None] + (logprobs - logprobs.detach())
    raw_ratio = torch.exp(log_ratio)
    # truncated importance sampling against the behaviour policy
    ratio = raw_ratio.clamp(max=ratio_cap) if ratio_cap > 0 else raw_ratio
    unclipped = ratio * adv
    clipped = ratio.clamp(1 - clip_low, 1 + clip_high) * adv
    loss = -torch.minimum(unclipped, clipped)
    if dual_clip > 0:
        # for A < 0 the clipped term alone is unbounded in the ratio: cap the token's loss at -c * A
        loss = torch.where(adv < 0, torch.minimum(loss, -dual_clip * adv), loss)
    if ref_logprobs is not None and beta > 0:
        kl = kl_penalty(logprobs, ref_logprobs, kl_estimator, log_ratio_clamp=kl_log_ratio_clamp, kl_max=kl_max)
        # DeepSeek-V3.2's correction, TRL's use_bias_correction_kl: weighting by the untruncated, differentiable
        # pi / pi_old makes the estimate unbiased for KL(pi || pi_ref) under pi_old; the metric keeps plain kl
        loss = loss + beta * (kl * raw_ratio if bias_correction_kl else kl)
    else:
        kl = torch.zeros_like(logprobs)
    if entropy_coef > 0:
        loss = loss - entropy_coef * entropy
    mask = mask.to(loss.dtype)
    ratio = ratio.detach()
    return TokenTerms(
        # weights turn torchtitan's division by global tokens into the configured aggregation
        loss=loss * weights.to(loss.dtype)[:, None] * mask,
        kl=kl.detach() * mask,
        ratio=ratio,
        clipped_low=(ratio < 1 - clip_low) & (adv < 0) & (mask > 0),
        clipped_high=(ratio > 1 + clip_high) & (adv > 0) & (mask > 0),
    )


def grpo_loss(pred, labels: torch.Tensor, *, token_terms_fn, stats=None) -> torch.Tensor:
    """Weighted sum of the per-token GRPO loss over completion tokens; records metrics in `stats` (GRPOStats).

    With [grpo] fused_policy_pass the model computed the loss and its gradients already
    (`pred.fused_loss`); the terms are evaluated here only for the metrics.
    """
    pred, labels = pred.padded(labels)  # a padding-free row's tokens, each under its completion
    mask = labels != IGNORE_INDEX
    old = pred.logprobs.detach()
    if pred.old_logprobs is not None:
        # behaviour log-probs where the rollout has them (NaN elsewhere), on-policy otherwise
        old = torch.where(pred.old_logprobs.isnan(), old, pred.old_logprobs)
    fused = pred.fused_loss
    with torch.no_grad() if fused is not None else nullcontext():
        terms = token_terms_fn(pred.logprobs, old, pred.ref_logprobs, pred.advantages, pred.loss_weights, mask,
                               pred.entropy)
    loss = terms.loss.sum() if fused is None else fused
    if stats is not None:
        stats.record_tokens(terms, mask, pred)
        # plugin.runtime.guard checks these before the optimizer step, in plugin.runtime.guard.TERMS order
        stats.record_nonfinite(pred.advantages, pred.ref_logprobs, pred.logprobs * mask, loss.detach())
    return loss


def token_terms_fn(job_config):
    """grpo_token_terms with the run's [grpo] settings; compiled when [compile] components has 'loss'."""
    cfg = job_config.grpo
    # [B, T] and [B] arguments: a batch's rows and length, or a fused chunk's, change from call to call
    terms_fn = maybe_compiled(grpo_token_terms, compiles_loss(job_config), job_config.compile.backend, (0, 1))
    same_name = ("clip_low", "clip_high", "beta", "kl_estimator", "dual_clip", "entropy_coef", "kl_log_ratio_clamp",
                 "kl_max", "importance_sampling_level")  # [grpo] keys named as grpo_token_terms' arguments
    return partial(terms_fn, **{key: getattr(cfg, key) for key in same_name}, ratio_cap=cfg.behavior_ratio_cap,
                   bias_correction_kl=cfg.use_bias_correction_kl)


def build_grpo_loss(job_config, **kwargs):
    """The GRPO loss for torchtitan's TrainSpec; compiled when [compile] components has 'loss'."""
    del kwargs
    if compiles_loss(job_config):
        logger.info("Compiling the GRPO per-token loss with torch.compile")
    return partial(grpo_loss, token_terms_fn=token_terms_fn(job_config), stats=GRPOJob.of(job_config).stats)
