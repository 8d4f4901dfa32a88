"""The GRPO policy loss and its metrics against plain reference formulas."""

import math

import pytest
import torch

from megatron_grpo.loss import (CLIP_VARIANTS, RATIO_SOURCES, LossConfig, StatSet, finalize, grpo_advantages,
                                policy_loss, policy_loss_stats)
from megatron_grpo.registry import Registry
from tests._dist import run_distributed

B, T = 6, 9


def _batch(seed=0, beta_scale=0.3, alpha_scale=0.1):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(B, T, generator=g) * 30  # rollout log-probs spanning common/medium/rare
    shadow = old + alpha_scale * torch.randn(B, T, generator=g)
    log_probs = shadow + beta_scale * torch.randn(B, T, generator=g)
    adv = torch.randn(B, generator=g)
    mask = torch.rand(B, T, generator=g) > 0.25
    mask[:, 0] = True
    ref = log_probs + 0.05 * torch.randn(B, T, generator=g)
    return log_probs, old, shadow, adv, mask, ref


def _edge_batch(seed=0, beta_scale=0.3):
    """As ``_batch`` with the edge cases the loss must survive: A == 0 rows (an all-equal reward
    group) and a row without any valid token."""
    lp, old, shadow, adv, mask, _ = _batch(seed, beta_scale=beta_scale)
    adv, mask = adv.clone(), mask.clone()
    adv[1] = 0.0
    mask[4] = False
    return lp, old, shadow, adv, mask


def _ref_per_token(lp, old, shadow, adv, cfg, mask):
    """Plain formulas of every family (docstrings of ``loss/clips.py``)."""
    a = adv[:, None].expand_as(lp)
    if cfg.ratio == "train":
        r = torch.exp(lp - old)
    elif cfg.ratio == "shadow":
        r = torch.exp(shadow - old) * torch.exp(lp - lp.detach())
    else:
        r = torch.exp(lp - lp.detach())
    lo, hi = max(0.0, 1 - cfg.ratio_clip_min), 1 + cfg.ratio_clip_max
    if cfg.clip == "ppo":
        loss = -torch.min(r * a, torch.clamp(r, lo, hi) * a)
        return loss if cfg.ratio_clip_c is None else torch.where(a < 0, torch.min(loss, -a * cfg.ratio_clip_c), loss)
    if cfg.clip == "none":
        return -r * a
    if cfg.clip == "gspo":
        m = mask.float()
        s = torch.exp((torch.log(r.detach()) * m).sum(-1) / m.sum(-1).clamp(min=1))
        s_tok = s[:, None] * torch.exp(lp - lp.detach())
        return -torch.min(s_tok * a, torch.clamp(s_tok, lo, hi) * a)
    if cfg.clip == "cispo":
        return -torch.clamp(r.detach(), lo, hi) * a * lp
    if cfg.clip == "sapo":
        tau = torch.where(a > 0, torch.full_like(a, cfg.sapo_tau_pos), torch.full_like(a, cfg.sapo_tau_neg))
        return -a * torch.sigmoid(tau * (r - 1)) * 4 / tau
    w = torch.min(r * a, torch.clamp(r, lo, hi) * a).detach()
    if cfg.clip == "detach_center":
        w = w - w[mask].mean()
    return -w * lp


def _ref_loss(lp, old, shadow, adv, mask, cfg):
    per_tok = _ref_per_token(lp, old, shadow, adv, cfg, mask)
    if cfg.aggregation == "seq_mean_token_mean":
        m = mask.float()
        return ((per_tok * m).sum(-1) / m.sum(-1).clamp(min=1)).sum() / mask.any(-1).sum()
    return per_tok[mask].sum() / mask.sum()


FAMILIES = {"ppo": {}, "ppo-dual": dict(ratio_clip_c=1.5), "none": {}, "detach": {}, "detach_center": {},
            "gspo": dict(aggregation="seq_mean_token_mean"), "cispo": {}, "sapo": {}}


@pytest.mark.parametrize("ratio", ["train", "shadow", "one"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_loss_value_and_gradient_match_reference(ratio, family):
    """Every family against its plain formula, eps_low != eps_high, with A == 0 rows and an
    empty row, gradients by autograd."""
    lp, old, shadow, adv, mask = _edge_batch()
    cfg = LossConfig(ratio=ratio, clip=family.split("-")[0], ratio_clip_min=0.15, ratio_clip_max=0.25,
                     **FAMILIES[family])
    ours_lp = lp.clone().requires_grad_(True)
    ref_lp = lp.clone().requires_grad_(True)
    loss, metrics = policy_loss(ours_lp, old, adv, mask, cfg, shadow_log_probs=shadow)
    ref = _ref_loss(ref_lp, old, shadow, adv, mask, cfg)
    torch.testing.assert_close(loss, ref, atol=1e-6, rtol=1e-6)
    loss.backward()
    ref.backward()
    torch.testing.assert_close(ours_lp.grad, ref_lp.grad, atol=1e-7, rtol=1e-5)
    torch.testing.assert_close(metrics["loss/policy"], ref.detach(), atol=1e-6, rtol=1e-6)
    assert torch.equal(ours_lp.grad[4], torch.zeros(T))  # the empty row
    if family != "detach_center":  # centring gives A == 0 tokens the weight -mu_W
        assert torch.equal(ours_lp.grad[1], torch.zeros(T))


def test_ratio_values():
    from megatron_grpo.loss.ratios import one_ratio, shadow_ratio, train_ratio

    lp, old, shadow, *_ = _batch()
    torch.testing.assert_close(train_ratio(lp, old, shadow), torch.exp(lp - old))
    torch.testing.assert_close(shadow_ratio(lp, old, shadow), torch.exp(shadow - old))
    assert torch.equal(one_ratio(lp, old, shadow), torch.ones_like(lp))


def test_value_reads_log_probs_is_declared_truthfully():
    """``detach_center`` skips its pre-pass of the trainer's log-probs only for a source that declares its
    ratio value independent of them (given the shadow's): for every registered source, the declaration
    matches whether moving the trainer's log-probs moves the value."""
    from megatron_grpo.loss.ratios import value_reads_log_probs

    lp, old, shadow, *_ = _batch()
    for name in RATIO_SOURCES.names():
        source = RATIO_SOURCES.get(name)
        args = (3.0,) if getattr(source, "takes_gap_scale", False) else ()
        moved = not torch.equal(source(lp, old, shadow, *args), source(lp + 0.25, old, shadow, *args))
        assert value_reads_log_probs(name) == moved, name
    assert not value_reads_log_probs("shadow") and value_reads_log_probs("gap_scaled")


def test_gap_scaled_ratio_scales_only_beta_in_the_value():
    """k = 1 is ``train``, k = 0 is ``shadow``, k = 3 puts alpha + 3 beta in the value; the gradient is d lp
    whatever k; per-token k follows the generator's log-prob buckets; the config refuses misuse by key."""
    from megatron_grpo.loss.ratios import gap_scale_of, gap_scaled_ratio, shadow_ratio, train_ratio

    lp, old, shadow, adv, mask, _ = _batch()
    torch.testing.assert_close(gap_scaled_ratio(lp, old, shadow, 1.0), train_ratio(lp, old, shadow))
    torch.testing.assert_close(gap_scaled_ratio(lp, old, shadow, 0.0), shadow_ratio(lp, old, shadow))
    torch.testing.assert_close(gap_scaled_ratio(lp, old, shadow, 3.0), torch.exp(shadow - old + 3 * (lp - shadow)))
    k = gap_scale_of(torch.tensor([-30.0, -20.0, -12.0, -1.0]), 2.0, [[-20.0, 8.0], [-5.0, 4.0]])
    assert k.tolist() == [8.0, 8.0, 4.0, 2.0]
    lp1 = lp.clone().requires_grad_(True)
    lp2 = lp.clone().requires_grad_(True)
    cfg = dict(clip="none", aggregation="token_mean")
    policy_loss(lp1, old, adv, mask, LossConfig(ratio="gap_scaled", gap_scale=5.0, **cfg), shadow_log_probs=shadow)[0].backward()
    value = gap_scaled_ratio(lp, old, shadow, 5.0)
    (-(value * torch.exp(lp2 - lp2.detach()) * adv[:, None])[mask].mean()).backward()
    torch.testing.assert_close(lp1.grad, lp2.grad)
    _, m = policy_loss(lp, old, adv, mask, LossConfig(ratio="gap_scaled", gap_scale=5.0, **cfg), shadow_log_probs=shadow)
    m = finalize(*m.reduce(None)) if not isinstance(m, dict) else m
    torch.testing.assert_close(m["precision/gap_in_ratio_abs_mean"].double(),
                               5 * m["precision/beta_abs_mean"].double(), rtol=1e-5, atol=1e-7)
    for bad, match in ((dict(ratio="train", gap_scale=2.0), "act only with loss_fn.ratio=gap_scaled"),
                       (dict(ratio="gap_scaled", correction="tis"), "set loss_fn.correction=null"),
                       (dict(ratio="gap_scaled", gap_scale_by_logprob=[[-5.0, 1.0], [-20.0, 2.0]]), "ascending"),
                       (dict(ratio="gap_scaled", gap_scale=-1.0), "loss_fn.gap_scale")):
        with pytest.raises(ValueError, match=match):
            LossConfig(**bad)


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum"])
def test_aggregations(aggregation):
    lp, old, shadow, adv, mask, _ = _batch()
    cfg = LossConfig(ratio="train", clip="none", aggregation=aggregation)
    loss, _ = policy_loss(lp, old, adv, mask, cfg)
    per_tok = -torch.exp(lp - old) * adv[:, None]
    per_seq_sum = (per_tok * mask).sum(-1)
    expected = {
        "token_mean": per_seq_sum.sum() / mask.sum(),
        "seq_mean_token_mean": (per_seq_sum / mask.sum(-1)).mean(),
        "seq_mean_token_sum": per_seq_sum.mean(),
    }[aggregation]
    torch.testing.assert_close(loss, expected, atol=1e-6, rtol=1e-6)


CORR = dict(tis_cap=1.5, icepop_low=0.7, icepop_high=1.3, seq_mask_low=0.8, seq_mask_high=1.25, rs_low=0.6,
            rs_high=1.5, rs_threshold=0.05)


def _ref_correction(name, lr, mask, c=CORR):
    """Plain formulas, r = pi_proximal / pi_generator: ``(weight, raw)``."""
    lr, m = lr.clamp(-20, 20), mask.float()
    r = torch.exp(lr)
    s = torch.exp(((lr * m).sum(-1)).clamp(-20, 20))[:, None].expand_as(r)
    geo = torch.exp((lr * m).sum(-1) / m.sum(-1).clamp(min=1))[:, None]
    one = torch.ones_like(r)
    table = {
        "tis": (torch.minimum(r, c["tis_cap"] * one), r),
        "seq_tis": (torch.minimum(s, c["tis_cap"] * one), s),
        "icepop": (r * ((r >= c["icepop_low"]) & (r <= c["icepop_high"])), r),
        "mis": (r * (r <= c["tis_cap"]), r),
        "seq_mis": (s * (s <= c["tis_cap"]), s),
        "seq_mask_tis": (r * ((geo >= c["seq_mask_low"]) & (geo <= c["seq_mask_high"])), r),
    }
    if name in table:
        return table[name]
    level, kind = ("token", name[-2:]) if name.startswith("token") else (name.split("_")[1], name[-2:])
    stat = {"k1": -lr, "k2": 0.5 * lr ** 2, "k3": torch.exp(lr) - 1 - lr}[kind]
    if level == "sum":
        stat = (stat * m).sum(-1, keepdim=True)
    elif level == "mean":
        stat = (stat * m).sum(-1, keepdim=True) / m.sum(-1, keepdim=True).clamp(min=1)
    elif level == "max":
        stat = torch.where(m > 0, stat, torch.full_like(stat, -1e30)).amax(-1, keepdim=True)
    if kind == "k1":
        keep = (stat >= math.log(c["rs_low"])) & (stat <= math.log(c["rs_high"]))
    else:
        keep = stat <= c["rs_threshold"]
    return keep.expand_as(r).float(), one


ALL_CORRECTIONS = ["tis", "seq_tis", "icepop", "mis", "seq_mis", "seq_mask_tis", "token_k1", "token_k2",
                   "token_k3", "seq_sum_k1", "seq_sum_k2", "seq_sum_k3", "seq_mean_k1", "seq_mean_k2",
                   "seq_mean_k3", "seq_max_k2", "seq_max_k3"]


def test_every_registered_correction_is_tested():
    from megatron_grpo.loss import CORRECTIONS

    assert sorted(CORRECTIONS.names()) == sorted(ALL_CORRECTIONS)


@pytest.mark.parametrize("mode", ["decoupled", "bypass"])
@pytest.mark.parametrize("correction", ALL_CORRECTIONS + ["tis,seq_mean_k3"])
def test_corrections_apply_the_importance_weight_once(correction, mode):
    """Decoupled: PPO ratio against the proximal (trainer's own, detached) log-probs, times the
    truncated / masked IS weight proximal vs generator. Bypass: PPO ratio against the generator,
    times the correction's mask only. Never r * w(r) (the ratio counted twice). eps_low !=
    eps_high, A == 0 rows and an empty row included."""
    if correction in ("tis", "seq_tis") and mode == "bypass":
        with pytest.raises(ValueError, match="correction_mode=bypass has no effect"):
            LossConfig(correction=correction, correction_mode="bypass")
        return
    lp, old, shadow, adv, mask = _edge_batch(beta_scale=0.3)
    cfg = LossConfig(ratio="train", clip="ppo", correction=correction, correction_mode=mode, ratio_clip_min=0.1,
                     ratio_clip_max=0.3, **CORR)
    ours_lp, ref_lp = lp.clone().requires_grad_(True), lp.clone().requires_grad_(True)
    loss, metrics = policy_loss(ours_lp, old, adv, mask, cfg)
    w, raw = torch.ones_like(lp), torch.ones_like(lp)
    for name in correction.split(","):
        w_i, raw_i = _ref_correction(name, lp - old, mask)
        w, raw = w * w_i, raw * raw_i
    a = adv[:, None]
    if mode == "decoupled":
        r = torch.exp(ref_lp - ref_lp.detach())  # value 1: one update per rollout batch
    else:
        r, w = torch.exp(ref_lp - old), (w > 0).float()
    ref = (-torch.min(r * a, r.clamp(0.9, 1.3) * a) * w)[mask].sum() / mask.sum()
    torch.testing.assert_close(loss, ref, atol=1e-6, rtol=1e-6)
    loss.backward()
    ref.backward()
    torch.testing.assert_close(ours_lp.grad, ref_lp.grad, atol=1e-7, rtol=1e-5)
    expected = {"correction/weight_mean": w[mask].mean(), "correction/masked_fraction": (w[mask] == 0).float().mean(),
                "correction/raw_weight_mean": raw[mask].mean(), "correction/raw_weight_max": raw[mask].max(),
                "correction/raw_weight_min": raw[mask].min(),
                "correction/seq_masked_fraction": ((w == 0) & mask).any(-1).sum() / mask.any(-1).sum()}
    if mode == "decoupled":
        expected["correction/truncated_fraction"] = ((w > 0) & (w < raw))[mask].float().mean()
        assert metrics["clip/region_fraction"] == 0  # the ratio the clip sees is 1: nothing is clipped
    for name, value in expected.items():
        assert metrics[name].item() == pytest.approx(value.item(), abs=1e-6, rel=1e-6), name


def test_decoupled_shadow_ratio_weights_by_the_clean_ratio():
    lp, old, shadow, adv, mask, _ = _batch(beta_scale=0.5)
    cfg = LossConfig(ratio="shadow", clip="none", correction="tis", tis_cap=1.5)
    loss, _ = policy_loss(lp, old, adv, mask, cfg, shadow_log_probs=shadow)
    w = torch.exp(shadow - old).clamp(max=1.5)
    torch.testing.assert_close(loss, (-adv[:, None] * w)[mask].sum() / mask.sum(), atol=1e-6, rtol=1e-6)


def test_kl_penalty_k3():
    lp, old, shadow, adv, mask, ref = _batch()
    cfg0 = LossConfig(ratio="train", clip="none")
    cfg = LossConfig(ratio="train", clip="none", reference_policy_kl_penalty=0.1)
    base, _ = policy_loss(lp, old, adv, mask, cfg0, ref_log_probs=ref)
    loss, metrics = policy_loss(lp, old, adv, mask, cfg, ref_log_probs=ref)
    k3 = torch.exp(ref - lp) - (ref - lp) - 1
    torch.testing.assert_close(loss, base + 0.1 * k3[mask].mean(), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(metrics["policy/kl_ref"], k3[mask].mean(), atol=1e-6, rtol=1e-6)
    with pytest.raises(ValueError, match="ref_log_probs"):
        policy_loss(lp, old, adv, mask, cfg)


def _np_metrics(lp, old, shadow, adv, mask, eps_lo=0.2, eps_hi=0.2):
    """Reference for every precision/clip metric, token by token in plain Python."""
    toks = [(lp[i, j].item(), old[i, j].item(), shadow[i, j].item(), adv[i].item())
            for i in range(lp.shape[0]) for j in range(lp.shape[1]) if mask[i, j]]
    n = len(toks)
    beta = [a - s for a, _, s, _ in toks]
    alpha = [s - o for _, o, s, _ in toks]
    advs = [t[3] for t in toks]
    mean = lambda xs: sum(xs) / len(xs) if xs else 0.0  # noqa: E731
    nan_mean = lambda xs: sum(xs) / len(xs) if xs else math.nan  # noqa: E731  (a bucket without tokens)
    bm, am = mean(beta), mean(advs)
    bstd = math.sqrt(mean([(b - bm) ** 2 for b in beta]))
    astd = math.sqrt(mean([(a - am) ** 2 for a in advs]))
    out_region = lambda r: r < 1 - eps_lo or r > 1 + eps_hi  # noqa: E731
    zero = lambda r, a: (a > 0 and r > 1 + eps_hi) or (a < 0 and r < 1 - eps_lo)  # noqa: E731
    act = [math.exp(a + b) for a, b in zip(alpha, beta)]
    clean = [math.exp(a) for a in alpha]
    olds = [t[1] for t in toks]
    return {
        "precision/beta_mean": bm,
        "precision/beta_abs_mean": mean([abs(b) for b in beta]),
        "precision/beta_std": bstd,
        "precision/beta_abs_max": max(abs(b) for b in beta),
        "precision/beta_adv_corr": mean([(b - bm) * (a - am) for b, a in zip(beta, advs)]) / (bstd * astd),
        "precision/beta_abs_mean_common": nan_mean([abs(b) for b, o in zip(beta, olds) if o > -5]),
        "precision/beta_abs_mean_medium": nan_mean([abs(b) for b, o in zip(beta, olds) if -20 < o <= -5]),
        "precision/beta_abs_mean_rare": nan_mean([abs(b) for b, o in zip(beta, olds) if o <= -20]),
        "precision/alpha_abs_mean": mean([abs(a) for a in alpha]),
        "precision/snr": mean([abs(a) for a in alpha]) / max(mean([abs(b) for b in beta]), 1e-12),
        "clip/region_fraction": sum(out_region(r) for r in act) / n,
        "clip/phantom_region_fraction": sum(out_region(r) and not out_region(c) for r, c in zip(act, clean)) / n,
        "clip/legit_region_fraction": sum(out_region(r) and out_region(c) for r, c in zip(act, clean)) / n,
        "clip/rescued_region_fraction": sum(not out_region(r) and out_region(c) for r, c in zip(act, clean)) / n,
        "clip/zero_grad_fraction": sum(zero(r, a) for r, a in zip(act, advs)) / n,
        "clip/phantom_zero_grad_fraction": sum(zero(r, a) and not zero(c, a) for r, c, a in zip(act, clean, advs)) / n,
        "clip/legit_zero_grad_fraction": sum(zero(r, a) and zero(c, a) for r, c, a in zip(act, clean, advs)) / n,
        "policy/kl_rollout": mean([math.exp(s - o) - (s - o) - 1 for _, o, s, _ in toks]),
    }


def test_precision_and_clip_metrics_match_reference():
    lp, old, shadow, adv, mask, _ = _batch(beta_scale=0.3, alpha_scale=0.15)
    _, metrics = policy_loss(lp, old, adv, mask, LossConfig(), shadow_log_probs=shadow)
    expected = _np_metrics(lp, old, shadow, adv, mask)
    for name, value in expected.items():
        assert metrics[name].item() == pytest.approx(value, abs=1e-5), name
    assert expected["clip/phantom_region_fraction"] > 0 and expected["clip/rescued_region_fraction"] > 0
    assert expected["clip/legit_region_fraction"] > 0
    # no rare token (every rollout log-prob above -20): the rare bucket is empty, NaN (null in metrics.jsonl), not 0
    old2 = old * 0.6  # rollout log-probs in (-18, 0]; the same alpha and beta
    common = (old2 + (lp - old), old2, old2 + (shadow - old))
    _, metrics = policy_loss(common[0], common[1], adv, mask, LossConfig(), shadow_log_probs=common[2])
    expected = _np_metrics(*common, adv, mask)
    assert math.isnan(expected["precision/beta_abs_mean_rare"]) and math.isnan(metrics["precision/beta_abs_mean_rare"])
    assert metrics["precision/beta_abs_mean_medium"].item() == pytest.approx(expected["precision/beta_abs_mean_medium"])


def test_without_shadow_only_actual_metrics():
    lp, old, _, adv, mask, _ = _batch()
    _, metrics = policy_loss(lp, old, adv, mask, LossConfig())
    assert "clip/region_fraction" in metrics and "clip/zero_grad_fraction" in metrics
    assert not any(k.startswith("precision/") or "phantom" in k for k in metrics)


def test_beta_zero_when_trainer_equals_shadow():
    lp, old, _, adv, mask, _ = _batch()
    _, metrics = policy_loss(lp, old, adv, mask, LossConfig(), shadow_log_probs=lp.clone())
    assert metrics["precision/beta_abs_mean"].item() == 0.0
    assert metrics["clip/phantom_region_fraction"].item() == 0.0


def test_shadow_ratio_removes_phantom_clipping():
    lp, old, shadow, adv, mask, _ = _batch(beta_scale=0.4, alpha_scale=0.05)
    _, train = policy_loss(lp, old, adv, mask, LossConfig(ratio="train"), shadow_log_probs=shadow)
    _, fixed = policy_loss(lp, old, adv, mask, LossConfig(ratio="shadow"), shadow_log_probs=shadow)
    assert train["clip/phantom_zero_grad_fraction"] > 0.05
    assert fixed["clip/phantom_zero_grad_fraction"] == 0 and fixed["clip/phantom_region_fraction"] == 0


@pytest.mark.parametrize("ratio", ["train", "shadow"])
def test_zero_grad_fraction_equals_autograd_zero_gradients(ratio):
    lp, old, shadow, adv, mask, _ = _batch(beta_scale=0.4, alpha_scale=0.3)
    leaf = lp.clone().requires_grad_(True)
    loss, metrics = policy_loss(leaf, old, adv, mask, LossConfig(ratio=ratio), shadow_log_probs=shadow)
    loss.backward()
    zero = ((leaf.grad == 0) & mask).sum().item() / mask.sum().item()
    assert zero > 0
    assert metrics["clip/zero_grad_fraction"].item() == pytest.approx(zero, abs=1e-7)


def test_deployed_improvement_stats():
    from megatron_grpo.loss import deployed_improvement_stats

    lp, old, _, adv, mask, _ = _batch()
    after = lp + 0.01 * torch.sign(adv)[:, None]
    metrics = finalize(*deployed_improvement_stats(lp, after, adv, mask).reduce(None))
    assert metrics["policy/deployed_improvement"].item() == pytest.approx(0.01, abs=1e-6)


@pytest.mark.parametrize("bad, match", [
    (dict(mask="float"), "mask must be a bool"),
    (dict(old_log_probs="short"), "old_log_probs shape"),
    (dict(advantages="wrong"), "advantages shape"),
    (dict(log_probs="nan"), "log_probs has 2 non-finite"),
    (dict(mask="empty"), "empty mask"),
])
def test_bad_inputs_name_the_argument(bad, match):
    lp, old, shadow, adv, mask, _ = _batch()
    if bad.get("mask") == "float":
        mask = mask.float()
    if bad.get("mask") == "empty":
        mask = torch.zeros_like(mask)
    if "old_log_probs" in bad:
        old = old[:, :-1]
    if "advantages" in bad:
        adv = adv[:-1]
    if "log_probs" in bad:
        lp = lp.clone()
        lp[0, 0] = float("nan")
        lp[1, 0] = float("inf")
    with pytest.raises(ValueError, match=match):
        policy_loss(lp, old, adv, mask, LossConfig(), shadow_log_probs=shadow)


def test_config_validation_names_the_key():
    with pytest.raises(ValueError, match=r"loss_fn.ratio.*valid choices: gap_scaled, one, shadow, train"):
        LossConfig(ratio="bogus")
    with pytest.raises(ValueError, match="loss_fn.clip"):
        LossConfig(clip="bogus")
    with pytest.raises(ValueError, match="loss_fn.correction"):
        LossConfig(correction="bogus")
    with pytest.raises(ValueError, match="loss_fn.ratio_clip_min"):
        LossConfig(ratio_clip_min=-0.1)
    with pytest.raises(ValueError, match="loss_fn.correction_mode"):
        LossConfig(correction="icepop", correction_mode="sideways")
    LossConfig(ratio_clip_min=10.0, ratio_clip_max=10.0)  # the write-up's no-clip eps


def test_registries_refuse_duplicates_and_list_names():
    with pytest.raises(ValueError, match="already registered"):
        RATIO_SOURCES.register("train")(lambda *a: None)
    with pytest.raises(ValueError, match="valid choices: cispo, detach, detach_center, gspo, none, ppo, sapo"):
        CLIP_VARIANTS.get("nope")
    reg = Registry("thing")
    reg.add("lazy", "math:sqrt")
    assert reg.get("lazy")(4.0) == 2.0
    reg.add("broken", "no_such_module_xyz:f")
    with pytest.raises(ValueError, match="no_such_module_xyz"):
        reg.get("broken")


def test_user_ratio_source_plugs_in_without_editing_the_loss():
    name = "half_beta_test"
    if name not in RATIO_SOURCES:
        @RATIO_SOURCES.register(name)
        def half_beta(log_probs, old_log_probs, shadow_log_probs):
            mid = 0.5 * (log_probs.detach() + shadow_log_probs)
            return torch.exp(mid - old_log_probs) * torch.exp(log_probs - log_probs.detach())
    lp, old, shadow, adv, mask, _ = _batch()
    loss, _ = policy_loss(lp, old, adv, mask, LossConfig(ratio=name, clip="none"), shadow_log_probs=shadow)
    expected = -(torch.exp(0.5 * (lp + shadow) - old) * adv[:, None])[mask].mean()
    torch.testing.assert_close(loss, expected, atol=1e-6, rtol=1e-6)


def test_grpo_advantages():
    rewards = torch.tensor([1.0, 2.0, 3.0, 5.0, 5.0, 5.0])
    adv = grpo_advantages(rewards, 3)
    torch.testing.assert_close(adv[:3], torch.tensor([-1.0, 0.0, 1.0], dtype=torch.float64), atol=1e-5, rtol=0)
    assert torch.equal(adv[3:], torch.zeros(3, dtype=torch.float64))
    torch.testing.assert_close(grpo_advantages(rewards, 3, scale="none")[:3],
                               torch.tensor([-1.0, 0.0, 1.0], dtype=torch.float64))
    with pytest.raises(ValueError, match="group_size"):
        grpo_advantages(rewards, 4)


@pytest.mark.parametrize("value", [0.7, 2.9, -16.0, 1e-3])
@pytest.mark.parametrize("estimator", ["grpo", "dr_grpo", "rloo"])
def test_all_equal_reward_groups_get_exactly_zero_advantage(value, estimator):
    from megatron_grpo.loss import ADVANTAGE_ESTIMATORS

    rewards = torch.tensor([value] * 8 + [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0], dtype=torch.float32)
    adv = ADVANTAGE_ESTIMATORS.get(estimator)(rewards, 8)
    assert adv.dtype == torch.float64
    assert torch.equal(adv[:8], torch.zeros(8, dtype=torch.float64))
    assert adv[8:].abs().min() > 0.1


def test_advantages_match_the_peers_formulas():
    """The guide's names: grpo = verl's (r - mean) / (unbiased std + 1e-6), dr_grpo = r - mean, rloo = r minus
    the mean of the other members (verl's rloo, NeMo-RL's leave-one-out), from Python's statistics module;
    G = 1 gives 0 (as NeMo-RL; verl has no baseline there) and rloo refuses it."""
    import random
    import statistics

    from megatron_grpo.loss import ADVANTAGE_ESTIMATORS

    rng = random.Random(0)
    rewards = [float(rng.random() < 0.4) for _ in range(16)] + [rng.gauss(0.0, 3.0) for _ in range(16)]
    groups = [rewards[i:i + 8] for i in range(0, len(rewards), 8)]
    expected = {
        "grpo": [(r - statistics.mean(g)) / (statistics.stdev(g) + 1e-6) if len(set(g)) > 1 else 0.0
                 for g in groups for r in g],
        "dr_grpo": [r - statistics.mean(g) for g in groups for r in g],
        "rloo": [r - statistics.mean(g[:i] + g[i + 1:]) for g in groups for i, r in enumerate(g)],
    }
    for name, ref in expected.items():
        adv = ADVANTAGE_ESTIMATORS.get(name)(torch.tensor(rewards, dtype=torch.float64), 8)
        torch.testing.assert_close(adv, torch.tensor(ref, dtype=torch.float64), rtol=1e-12, atol=1e-12)
    single = torch.tensor([0.1, 0.3])
    for name in ("grpo", "dr_grpo"):
        assert torch.equal(ADVANTAGE_ESTIMATORS.get(name)(single, 1), torch.zeros(2, dtype=torch.float64))
    with pytest.raises(ValueError, match="group_size >= 2"):
        ADVANTAGE_ESTIMATORS.get("rloo")(single, 1)


# ---- the names shared with verl / NeMo-RL / TRL, against the peers' code transcribed independently --------
# verl    volcengine/verl@b178a3cd56f5  verl/trainer/ppo/core_algos.py (compute_policy_loss_vanilla / _gspo / _cispo /
#         _sapo, agg_loss, kl_penalty_forward "low_var_kl"), verl/trainer/ppo/rollout_corr_helper.py
#         (compute_rollout_correction_weights, compute_rollout_rejection_mask)
# NeMo-RL NVIDIA-NeMo/RL@7ea279abfbeb   nemo_rl/algorithms/loss/loss_functions.py (ClippedPGLossFn: tis / icepop /
#         seq-mask-tis weights)
# TRL     huggingface/trl@f2cd57710ae3  trl/trainer/grpo_trainer.py (vllm_importance_sampling_mode token_mask /
#         sequence_mask, clip_min None)
# Rejection keeps verl's masks; verl then drops the rejected tokens from response_mask (the token-mean denominator),
# here they stay with weight 0 (the guide says so): the reference divides by every valid token.

def _verl_agg_loss(mat, m, mode):
    if mode == "token-mean":
        return (mat * m).sum() / m.sum()
    n = m.sum(-1)
    seq = (mat * m).sum(-1) / ((n + 1e-8) if mode == "seq-mean-token-mean" else 1.0)
    return (seq * (n > 0)).sum() / (n > 0).sum()  # seq-mean: fully masked rows excluded


def _verl_policy_loss(family, lp, old, a, m, mode, lo, hi, c=None, w=None):
    """verl's loss_mode ``vanilla`` (dual clip with c) / ``gspo`` / ``cispo`` / ``sapo`` times the IS weight w."""
    if family == "gspo":
        seq = ((lp - old) * m).sum(-1) / m.sum(-1).clamp(min=1)
        r = torch.exp(torch.clamp(lp - lp.detach() + seq.detach()[:, None], max=10.0))
    else:
        r = torch.exp(torch.clamp(lp - old, min=-20.0, max=20.0))
    if family == "cispo":
        pg = -torch.clamp(r, 1 - lo, 1 + hi).detach() * a * lp
    elif family == "sapo":
        tau = torch.where(a > 0, torch.full_like(a, 1.0), torch.full_like(a, 1.05))
        pg = -torch.sigmoid(tau * (r - 1.0)) * (4.0 / tau) * a
    else:
        pg = torch.maximum(-a * r, -a * torch.clamp(r, 1 - lo, 1 + hi))
        if c is not None:
            pg = torch.where(a < 0, torch.min(-a * c, pg), pg)
    return _verl_agg_loss(pg if w is None else pg * w, m, mode)


def _peer_correction(name, lr, m, c):
    """The weight of correction ``name`` as the peer that owns the name computes it (lr = log pi_old / pi_rollout)."""
    seq_sum = (lr * m).sum(-1, keepdim=True)
    if name in ("tis", "seq_tis"):  # verl rollout_is = token / sequence
        w = torch.exp((lr if name == "tis" else seq_sum).clamp(-20.0, 20.0)).expand_as(lr) * m
        return w.clamp(max=c["tis_cap"])
    if name in ("mis", "seq_mis"):  # TRL token_mask / sequence_mask
        r = torch.exp(lr * m if name == "mis" else seq_sum).expand_as(lr)
        return r.masked_fill(r > c["tis_cap"], 0.0)
    r = torch.exp(lr)
    if name == "icepop":  # NeMo-RL
        return torch.where((r >= c["icepop_low"]) & (r <= c["icepop_high"]), r, torch.zeros_like(r))
    if name == "seq_mask_tis":  # NeMo-RL: geometric mean over token_mask, masked_mean's 1e-8
        geo = torch.exp((lr * m).sum(-1) / (m.sum(-1) + 1e-8))
        return r * ((geo >= c["seq_mask_low"]) & (geo <= c["seq_mask_high"])).float()[:, None]
    lr = lr.clamp(-20.0, 20.0)  # verl rollout_rs
    k = {"k1": -lr, "k2": 0.5 * lr ** 2, "k3": torch.exp(lr) - 1.0 - lr}[name[-2:]]
    if name.startswith("seq_sum"):
        k = (k * m).sum(-1, keepdim=True)
    elif name.startswith("seq_mean"):
        k = (k * m).sum(-1, keepdim=True) / (m.sum(-1, keepdim=True) + 1e-8)
    elif name.startswith("seq_max"):
        k = k.masked_fill(m == 0, float("-inf")).max(-1, keepdim=True).values
        k = torch.where(k == float("-inf"), torch.zeros_like(k), k)
    if name.endswith("k1"):
        keep = (k >= math.log(c["rs_low"])) & (k <= math.log(c["rs_high"]))
    else:
        keep = k <= c["rs_threshold"]
    return keep.expand_as(lr).float()


PEER_CASES = [  # (our config, the peer's family, its aggregation, dual clip c)
    (dict(), "vanilla", "token-mean", None),
    (dict(aggregation="seq_mean_token_mean"), "vanilla", "seq-mean-token-mean", None),
    (dict(aggregation="seq_mean_token_sum"), "vanilla", "seq-mean-token-sum", None),
    (dict(ratio_clip_c=3.0), "vanilla", "token-mean", 3.0),
    (dict(clip="gspo", aggregation="seq_mean_token_mean"), "gspo", "seq-mean-token-mean", None),
    (dict(clip="cispo"), "cispo", "token-mean", None),
    (dict(clip="sapo", aggregation="seq_mean_token_mean"), "sapo", "seq-mean-token-mean", None),
]
PEER_THRESHOLDS = {"token": 0.045, "seq_sum": 0.3, "seq_mean": 0.045, "seq_max": 0.15}


def test_losses_and_corrections_match_the_peers_code():
    """Every shared name against the peer's code (above), values and gradients: the PPO clip and verl's dual clip,
    gspo, cispo, sapo and the aggregations (verl), the k3 KL penalty (verl's low_var_kl, = NeMo-RL's value: the
    log-ratio clamped to +-20, the k3 to <= 10), and every correction in decoupled mode (verl / NeMo-RL / TRL
    weights). eps_low != eps_high, an A == 0 row, an empty row, ratios > 3 at A < 0 tokens, k3 > 10 tokens."""
    lp, old, _, adv, mask = _edge_batch(beta_scale=0.3)
    far = lp.clone()
    far[:, 2] = old[:, 2] + 1.3  # ratio 3.7: dual clip territory
    ref = lp + 0.3 * torch.randn(lp.shape, generator=torch.Generator().manual_seed(1))
    ref[:, 5] = lp[:, 5] + 3.0  # k3 = e^3 - 4 > 10
    m, a, lo, hi = mask.float(), adv[:, None].expand_as(lp), 0.1, 0.3
    cases = [(far, dict(cfg, reference_policy_kl_penalty=beta), fam, mode, c, None, beta)
             for cfg, fam, mode, c in PEER_CASES for beta in (0.0, 0.1)]
    for name in ALL_CORRECTIONS:
        level = next((k for k in PEER_THRESHOLDS if name.startswith(k)), "token")
        knobs = dict(CORR, rs_threshold=PEER_THRESHOLDS[level], rs_low=0.8, rs_high=1.25)
        w = _peer_correction(name, lp - old, m, knobs)
        acts = ((w == 0) | (w == knobs["tis_cap"])) & mask  # truncated or dropped somewhere, kept somewhere
        assert acts.any() and ((w > 0) & mask).any(), name
        cases.append((lp, dict(correction=name, **knobs), "vanilla", "token-mean", None, w, 0.0))
    for lp, cfg, family, mode, c, w, beta in cases:
        ours_lp, ref_lp = lp.clone().requires_grad_(True), lp.clone().requires_grad_(True)
        loss, _ = policy_loss(ours_lp, old, adv, mask, LossConfig(ratio_clip_min=lo, ratio_clip_max=hi, **cfg),
                              ref_log_probs=ref)
        base = old if w is None else ref_lp.detach()  # decoupled: the PPO ratio against the proximal policy
        expected = _verl_policy_loss(family, ref_lp, base, a, m, mode, lo, hi, c, w)
        if beta:
            low_var_kl = torch.clamp(torch.exp((ref - ref_lp).clamp(-20, 20)) - (ref - ref_lp).clamp(-20, 20) - 1,
                                     min=-10, max=10)
            expected = expected + beta * _verl_agg_loss(low_var_kl, m, mode)
        torch.testing.assert_close(loss, expected, atol=1e-6, rtol=1e-5, msg=str(cfg))
        loss.backward()
        expected.backward()
        torch.testing.assert_close(ours_lp.grad, ref_lp.grad, atol=1e-7, rtol=1e-5, msg=str(cfg))


# ---- data parallel + micro-batches == one process ---------------------------------------------------

CONFIGS = [LossConfig(), LossConfig(ratio="shadow", aggregation="seq_mean_token_mean"),
           LossConfig(clip="none", correction="icepop", icepop_low=0.8, icepop_high=1.2),
           LossConfig(clip="detach_center"), LossConfig(ratio="shadow", clip="detach_center"),
           LossConfig(clip="gspo", aggregation="seq_mean_token_mean", ratio_clip_min=0.05, ratio_clip_max=0.1),
           LossConfig(clip="cispo", ratio_clip_min=0.1), LossConfig(clip="sapo"),
           LossConfig(ratio_clip_c=1.5, correction="tis,seq_mean_k3,seq_max_k2", rs_threshold=0.5),
           LossConfig(correction="seq_mis,seq_mask_tis", correction_mode="bypass", seq_mask_low=0.5,
                      seq_mask_high=2.0)]


def _dp_worker_one(cfg_index, rank, group, empty_rows=False):
    from megatron_grpo.loss.policy import weight_center

    lp, old, shadow, adv, mask, _ = _batch(seed=4)
    if empty_rows:
        mask = mask.clone()
        mask[B // 2:] = False  # rank 1 holds no valid token at all
    mine = slice(rank * B // 2, (rank + 1) * B // 2)
    rows = [slice(0, 1), slice(1, 3)]
    local = [t[mine] for t in (lp, old, shadow, adv, mask)]
    # global counts come from the whole batch (the trainer computes them once per step)
    leaf = local[0].clone().requires_grad_(True)
    stats = StatSet()
    n_tok, n_seq = mask.sum().double(), mask.any(-1).sum().double()
    # detach_center: mu_W of the whole global batch, as the step's pre-pass computes it
    center = weight_center(local[0], local[1], local[3], local[4], CONFIGS[cfg_index], shadow_log_probs=local[2],
                           dp_group=group)
    for sl in rows:
        loss, s = policy_loss_stats(leaf[sl], local[1][sl], local[3][sl], local[4][sl], CONFIGS[cfg_index],
                                    shadow_log_probs=local[2][sl], num_global_tokens=n_tok, num_global_seqs=n_seq,
                                    weight_center=center, dp_group=group)
        loss.backward()
        stats.merge(s)
    return leaf.grad, finalize(*stats.reduce(group))


def _dp_worker():
    import torch.distributed as dist

    from megatron_grpo.parallel import state

    state.init_distributed()
    rank = dist.get_rank()
    out = [_dp_worker_one(i, rank, dist.group.WORLD) for i in range(len(CONFIGS))]
    return out + [_dp_worker_one(0, rank, dist.group.WORLD, empty_rows=True)]


def test_dp2_microbatches_match_single_process():
    """Every config (detach_center included), and a rank whose rows hold no valid token (it must
    keep running the same collectives: no raise on one rank only)."""
    results = run_distributed(_dp_worker, 2, timeout=300)
    cases = [(i, False) for i in range(len(CONFIGS))] + [(0, True)]
    for k, (cfg_index, empty_rows) in enumerate(cases):
        lp, old, shadow, adv, mask, _ = _batch(seed=4)
        if empty_rows:
            mask = mask.clone()
            mask[B // 2:] = False
        leaf = lp.clone().requires_grad_(True)
        loss, single = policy_loss(leaf, old, adv, mask, CONFIGS[cfg_index], shadow_log_probs=shadow)
        loss.backward()
        grad = torch.cat([r[k][0] for r in results], dim=0)
        torch.testing.assert_close(grad, leaf.grad, atol=1e-6, rtol=1e-6, msg=f"config {cfg_index}")
        for rank_result in results:
            metrics = rank_result[k][1]
            assert set(metrics) == set(single)
            for name in single:
                assert metrics[name].item() == pytest.approx(single[name].item(), abs=1e-6, nan_ok=True), name


def test_detach_center_uses_the_given_global_mean():
    """Micro-batches centre on mu_W of the whole batch (given), not on their own mean."""
    from megatron_grpo.loss.policy import weight_center

    lp, old, shadow, adv, mask, _ = _batch(seed=2)
    cfg = LossConfig(clip="detach_center")
    full = lp.clone().requires_grad_(True)
    loss, _ = policy_loss(full, old, adv, mask, cfg)
    loss.backward()
    center = weight_center(lp, old, adv, mask, cfg)
    parts = lp.clone().requires_grad_(True)
    n_tok, n_seq = mask.sum().double(), mask.any(-1).sum().double()
    for sl in (slice(0, 1), slice(1, 4), slice(4, B)):
        part, _ = policy_loss(parts[sl], old[sl], adv[sl], mask[sl], cfg, num_global_tokens=n_tok,
                              num_global_seqs=n_seq, weight_center=center)
        part.backward()
    torch.testing.assert_close(parts.grad, full.grad, atol=1e-7, rtol=1e-6)
    w = torch.min(torch.exp(lp - old) * adv[:, None], torch.exp(lp - old).clamp(0.8, 1.2) * adv[:, None])
    assert center.item() == pytest.approx(w[mask].mean().item(), abs=1e-6)


def test_snr_is_nan_when_beta_is_exactly_zero():
    lp, old, _, adv, mask, _ = _batch()
    _, metrics = policy_loss(lp, old, adv, mask, LossConfig(), shadow_log_probs=lp.clone())
    assert metrics["precision/beta_abs_mean"].item() == 0.0
    assert math.isnan(metrics["precision/snr"].item())


def test_kl_rollout_k3_is_unbiased_for_kl_rollout_to_current():
    """Tokens sampled from the rollout policy q: mean of (r - 1) - log r, r = p / q, is KL(q || p)."""
    from megatron_grpo.loss.metrics import k3, kl_rollout_k3

    g = torch.Generator().manual_seed(0)
    log_q = torch.log_softmax(torch.randn(6, generator=g) * 2, -1)
    log_p = torch.log_softmax(torch.randn(6, generator=g) * 2, -1)
    exact = (log_q.exp() * (log_q - log_p)).sum().item()
    reverse = (log_p.exp() * (log_p - log_q)).sum().item()
    tokens = torch.multinomial(log_q.exp(), 400_000, replacement=True, generator=g)
    ours = kl_rollout_k3(log_p[tokens], log_q[tokens]).mean().item()
    assert ours == pytest.approx(exact, rel=0.02)
    assert abs(k3(log_p[tokens], log_q[tokens]).mean().item() - exact) > 0.1 * exact  # the old orientation
    assert abs(exact - reverse) > 0.1 * exact
    lp, old, shadow, adv, mask, _ = _batch()
    _, metrics = policy_loss(lp, old, adv, mask, LossConfig(), shadow_log_probs=shadow)
    torch.testing.assert_close(metrics["policy/kl_rollout"], kl_rollout_k3(shadow, old)[mask].mean(), atol=1e-6,
                               rtol=1e-6)


def test_large_eps_and_log_ratios_beyond_the_clamp_keep_their_gradient():
    """eps = 10 (the write-up's no-clip run) is accepted; a token whose log-ratio is beyond the
    +-20 value clamp still has a gradient (the clamp acts on the value only)."""
    lp, old, shadow, adv, mask, _ = _batch()
    old = old.clone()
    adv = adv.clone()
    adv[0] = -1.0
    old[0, 0] = lp[0, 0] - 25.0  # log r = +25 with A < 0: PPO's unclipped branch wins
    for cfg in (LossConfig(), LossConfig(ratio_clip_min=10.0, ratio_clip_max=10.0)):
        leaf = lp.clone().requires_grad_(True)
        loss, metrics = policy_loss(leaf, old, adv, mask, cfg)
        loss.backward()
        assert torch.isfinite(leaf.grad).all() and leaf.grad[0, 0] > 0
        zero = ((leaf.grad == 0) & mask).sum().item() / mask.sum().item()
        assert metrics["clip/zero_grad_fraction"].item() == pytest.approx(zero, abs=1e-7)
    assert metrics["clip/zero_grad_fraction"] == 0  # eps = 10: nothing in [-9, 11] ... every token keeps its gradient


def _constructed(beta_of_row):
    """alpha = 0 (shadow = old), beta set per row: rows 0-3 with A > 0, rows 4-7 with A < 0."""
    rows = len(beta_of_row)
    old = torch.full((rows, 4), -2.0)
    beta = torch.tensor(beta_of_row, dtype=torch.float32)
    lp = old + beta
    adv = torch.tensor([1.0] * (rows // 2) + [-1.0] * (rows // 2))
    return lp, old, old.clone(), adv, torch.ones(rows, 4, dtype=torch.bool)


B_UP, B_DN = 0.3, -0.3
TOKEN_ROWS = [[B_UP] * 4, [B_DN] * 4, [0.0] * 4, [B_UP, B_DN, 0.0, 0.0]] * 2
SAPO_ROWS = [[1.5] * 4, [-1.5] * 4, [0.0] * 4, [1.5, -1.5, 0.0, 0.0]] * 2


@pytest.mark.parametrize("family, rows, expected", [
    # token level, eps 0.2: |beta| = 0.3 leaves the region (10 tokens per half); the clean ratio
    # (alpha = 0) never does. ppo zeroes A>0 & r>1.2 (row 0, row 3's first token) and A<0 & r<0.8
    # (row 5, row 7's second token)
    ("ppo", TOKEN_ROWS, dict(phantom_region=20 / 32, phantom_zero_grad=10 / 32, legit_zero_grad=0.0,
                             phantom_truncated=0.0)),
    # dual clip c = 1.3 also zeroes A<0 & r = 1.35 > c (rows 4, 7's first token)
    ("ppo-dual", TOKEN_ROWS, dict(phantom_region=20 / 32, phantom_zero_grad=15 / 32, phantom_truncated=0.0)),
    # sequence level: the sequence ratio of rows 0/1 is 1.35 / 0.74; rows 2/3 average to 1: never gated
    ("gspo", TOKEN_ROWS, dict(phantom_region=16 / 32, phantom_zero_grad=8 / 32, phantom_truncated=0.0)),
    # cispo truncates the weight of every token outside the region, zeroes none
    ("cispo", TOKEN_ROWS, dict(phantom_region=20 / 32, phantom_zero_grad=0.0, phantom_truncated=20 / 32)),
    # sapo: g(r) = 4 sigma(1 - sigma) < 1/2 only for r = e^1.5 (x = 3.5, g = 0.1); e^-1.5 gives g = 0.86
    ("sapo", SAPO_ROWS, dict(phantom_region=20 / 32, phantom_zero_grad=0.0, phantom_truncated=10 / 32)),
])
def test_phantom_metrics_from_each_familys_gate_match_hand_counts(family, rows, expected):
    lp, old, shadow, adv, mask = _constructed(rows)
    cfg = LossConfig(clip=family.split("-")[0], ratio_clip_c=1.3 if family == "ppo-dual" else None)
    leaf = lp.clone().requires_grad_(True)
    loss, metrics = policy_loss(leaf, old, adv, mask, cfg, shadow_log_probs=shadow)
    for name, value in expected.items():
        kind, _, what = name.partition("_")
        key = f"clip/{kind}_{what}_fraction"
        assert metrics[key].item() == pytest.approx(value, abs=1e-7), key
    assert metrics["clip/legit_region_fraction"] == 0 and metrics["clip/rescued_region_fraction"] == 0
    loss.backward()  # the declared zero-gradient tokens are exactly autograd's zeros
    assert metrics["clip/zero_grad_fraction"].item() == pytest.approx((leaf.grad == 0).float().mean().item())
    _, clean = policy_loss(lp, old, adv, mask, LossConfig(clip=cfg.clip, ratio="shadow",
                                                          ratio_clip_c=cfg.ratio_clip_c), shadow_log_probs=shadow)
    assert clean["clip/phantom_zero_grad_fraction"] == 0 and clean["clip/phantom_truncated_fraction"] == 0


@pytest.mark.parametrize("family", ["ppo-dual", "gspo", "cispo", "sapo"])
def test_zero_grad_fraction_equals_autograd_zeros_for_every_family(family):
    lp, old, shadow, adv, mask = _edge_batch(beta_scale=0.6)
    adv[1] = 0.5
    cfg = LossConfig(clip=family.split("-")[0], ratio_clip_c=1.5 if family == "ppo-dual" else None,
                     ratio_clip_min=0.1, ratio_clip_max=0.2)
    leaf = lp.clone().requires_grad_(True)
    loss, metrics = policy_loss(leaf, old, adv, mask, cfg, shadow_log_probs=shadow)
    loss.backward()
    zero = ((leaf.grad == 0) & mask).sum().item() / mask.sum().item()
    assert metrics["clip/zero_grad_fraction"].item() == pytest.approx(zero, abs=1e-7)
    if family in ("ppo-dual", "gspo"):
        assert zero > 0


def test_verl_sequence_metrics_average_over_every_row_an_empty_one_adding_its_zero():
    """verl's ``rollout_corr/log_ppl_abs_diff`` and ``chi2_seq`` (``compute_offpolicy_metrics``) are
    batch means over every row: an empty completion adds |0| and e^0 = 1; per-token log-ratios are
    not clamped (only the sequence sum, for chi2_seq). Hand-computed, lr = train - gen:
    row 0 lr (0.5, -1), means gen -1.25, train -1.5; row 1 one token, lr -0.3; row 2 empty;
    row 3 lr (25, -10)."""
    train = torch.tensor([[-1.0, -2.0], [-0.5, -9.0], [-3.0, -4.0], [-5.0, -20.0]], dtype=torch.float64)
    gen = torch.tensor([[-1.5, -1.0], [-0.2, -1.0], [-1.0, -1.0], [-30.0, -10.0]], dtype=torch.float64)
    mask = torch.tensor([[True, True], [True, False], [False, False], [True, True]])
    _, m = policy_loss(train, gen, torch.zeros(4, dtype=torch.float64), mask, LossConfig(), shadow_log_probs=train)
    assert m["compat/rollout_corr/log_ppl_abs_diff"].item() == pytest.approx((0.25 + 0.3 + 0.0 + 7.5) / 4, rel=1e-6)
    chi2_seq = (math.exp(-1.0) + math.exp(-0.6) + 1.0 + math.exp(30.0)) / 4 - 1.0
    assert m["compat/rollout_corr/chi2_seq"].item() == pytest.approx(chi2_seq, rel=1e-6)


def test_peer_mismatch_metrics_match_their_definitions():
    """NeMo-RL's and verl's names, from the trainer's own log-probs (train) and the generator's."""
    lp, old, shadow, adv, mask = _edge_batch(beta_scale=0.4)
    _, m = policy_loss(lp, old, adv, mask, LossConfig(), shadow_log_probs=shadow)
    v = mask
    lr = lp - old
    seq_lr = (lr * mask).sum(-1)  # verl: every row (row 4 is empty: lr sum 0)
    n_tok = mask.sum(-1).clamp(min=1)
    expected = {
        "compat/token_mult_prob_error": torch.exp((old - lp).abs())[v].mean(),
        "compat/gen_kl_error": (torch.exp(lr) - 1 - lr)[v].mean(),
        "compat/sampling_importance_ratio": torch.exp(lr)[v].mean(),
        "compat/rollout_corr/kl": (old - lp)[v].mean(),
        "compat/rollout_corr/k3_kl": (torch.exp(lr) - 1 - lr)[v].mean(),
        "compat/rollout_corr/chi2_token": (torch.exp(lr) ** 2)[v].mean() - 1,
        "compat/rollout_corr/chi2_seq": torch.exp(2 * seq_lr).mean() - 1,
        "compat/rollout_corr/log_ppl_abs_diff": ((old * mask).sum(-1) / n_tok - (lp * mask).sum(-1) / n_tok).abs().mean(),
    }
    for name, value in expected.items():
        assert m[name].item() == pytest.approx(value.item(), rel=1e-5, abs=1e-6), name
    _, tis = policy_loss(lp, old, adv, mask, LossConfig(correction="tis", tis_cap=1.2), shadow_log_probs=shadow)
    assert tis["compat/sampling_importance_ratio"].item() == pytest.approx(  # after truncation, as NeMo-RL
        torch.exp(lr).clamp(max=1.2)[v].mean().item(), rel=1e-6)
