"""One GRPO optimisation step on Megatron-Core: shadow forward, forward-backward, optimizer, probes.

The forward-backward runs inside Megatron's schedule (``get_forward_backward_func``)
with the ``(loss, num_tokens, metrics)`` loss contract and ``calculate_per_token_loss``;
our losses are already normalised by the *global* valid-token count, so summing
micro-batches and data-parallel ranks gives the exact global token mean.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from megatron.core import parallel_state as ps
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.transformer.dot_product_attention import DotProductAttention

from megatron_grpo import faults
from megatron_grpo.compat.megatron import moe_aux_loss_token_multiplier
from megatron_grpo.config.schema import Config, to_dtype
from megatron_grpo.loss import StatSet, clips, policy_loss_stats, ratios
from megatron_grpo.loss.metrics import SHADOW_STATS, routing_stats
from megatron_grpo.loss.policy import weight_center
from megatron_grpo.loss.stats import masked_sum
from megatron_grpo.models import forward_logits, model_chunks, sequence_multiple, unwrap
from megatron_grpo.models.forward import (
    PackedBatch,
    forward_log_probs,
    log_probs_from_logits,
    model_device,
    pack,
    pipeline_dtype,
    plan_iterators,
    precision_context,
)
from megatron_grpo.models.packing import (
    MicroBatch,
    PlanSpec,
    build_plan,
    log_packing_cost,
    needed_lengths,
    plan_groups,
    plan_shapes,
    split_to_count,
    step_rows,
)
from megatron_grpo.models.routing import Routing, generator_routes, select_layers
from megatron_grpo.parallel import comm
from megatron_grpo.parallel import grads as grad_utils
from megatron_grpo.rollout import Rollouts


@dataclass
class StepBatch:
    """This DP rank's rows of the step's batch, plus global counts."""

    packed: PackedBatch
    old_log_probs: torch.Tensor
    """[b, S] generator log-probs aligned with ``packed.labels``"""
    advantages: torch.Tensor
    """[b]"""
    num_global_tokens: torch.Tensor
    num_global_seqs: torch.Tensor
    routes: Optional[torch.Tensor] = None
    """R3: ``[b, S, layers, k]`` experts the generator routed each position to (-1: none)"""

    def to(self, device) -> "StepBatch":
        return StepBatch(self.packed.to(device), self.old_log_probs.to(device), self.advantages.to(device),
                         self.num_global_tokens.to(device), self.num_global_seqs.to(device),
                         None if self.routes is None else self.routes.to(device))


def build_step_batch(rollouts: Rollouts, advantages: torch.Tensor, dp_rank: int, dp_size: int,
                     pad_id: int, step: int = 0, balance_tokens: bool = False) -> StepBatch:
    """Packs all rollouts (identically on every rank) and keeps this DP rank's contiguous rows.

    Checks that need every rank to agree run here, on the whole batch that every rank holds, so
    that all ranks raise together (never one rank inside the schedule's collectives): a batch
    without any valid completion token, a completion whose log-probs do not match its tokens one to one,
    or non-finite generator log-probs / advantages.
    Advantages stay float64 (the loss casts them). ``balance_tokens`` (``PlanSpec.balances_tokens``: token
    budgets or packing): each DP rank gets the same number of sequences, chosen to balance tokens, instead
    of contiguous rows."""
    seqs = [r.prompt_ids + r.completion_ids for r in rollouts]
    prompt_lens = [len(r.prompt_ids) for r in rollouts]
    _check_log_prob_counts(rollouts, step)
    packed = pack(seqs, prompt_lens, pad_id)
    old = torch.zeros(packed.labels.shape, dtype=torch.float32)
    for i, r in enumerate(rollouts):
        start = prompt_lens[i] - 1
        old[i, start : start + len(r.logprobs)] = torch.tensor(r.logprobs, dtype=torch.float32)
    _check_whole_batch(packed, old, advantages, step)
    sl = step_rows([len(s) for s in seqs], dp_rank, dp_size, balance_tokens)
    routes = generator_routes(rollouts, packed.input_ids.shape[1])
    return StepBatch(packed.rows(sl), old[sl], advantages[sl].double(), packed.mask.sum().double(),
                     packed.mask.any(-1).sum().double(), None if routes is None else routes[sl])


def _check_log_prob_counts(rollouts: Rollouts, step: int) -> None:
    """One generator log-prob per sampled token: a shorter list would leave 0.0 (probability one) as the
    old log-prob of the tokens it misses, a longer one would shift onto the next sequence's padding."""
    for i, r in enumerate(rollouts):
        if len(r.logprobs) != len(r.completion_ids):
            raise ValueError(f"step {step}: the generator returned {len(r.logprobs)} log-probs for the "
                             f"{len(r.completion_ids)} tokens of completion {i} (prompt {r.prompt_index})")


def _check_whole_batch(packed: PackedBatch, old: torch.Tensor, advantages: torch.Tensor, step: int) -> None:
    if not bool(packed.mask.any()):
        raise ValueError(f"step {step}: the batch has no valid completion token (every completion is empty)")
    bad = int((~torch.isfinite(old) & packed.mask).sum())
    if bad:
        raise ValueError(f"step {step}: the generator returned {bad} non-finite log-probs for sampled tokens")
    if not bool(torch.isfinite(advantages).all()):
        raise ValueError(f"step {step}: non-finite advantages (check the reward function's values)")


class TrainStep:
    """Runs the step's forwards and backward for one model (this rank's shard)."""

    def __init__(self, model, optimizer, cfg: Config, tp_group, dp_group, ref_model=None):
        self.model, self.optimizer, self.cfg = model, optimizer, cfg
        self.tp_group, self.dp_group, self.ref_model = tp_group, dp_group, ref_model
        p = cfg.policy.precision
        self.params_dtype, self.compute_dtype = to_dtype(p.params_dtype), to_dtype(p.compute_dtype)
        self.loss_cfg = dataclasses.replace(cfg.loss_fn, check_finite=False)
        """The step checks finiteness itself, agreed across ranks (``_sanitize``, ``build_step_batch``)."""
        self.shadow_dtype = to_dtype(p.shadow_dtype)
        self.routing = make_routing(model, cfg)
        if ref_model is not None:
            make_routing(ref_model, cfg)  # the reference's router gate in moe_router_dtype too
        self.replay = cfg.policy.megatron_cfg.moe_routing_replay
        router_gap = self.routing is not None and self.routing.shadow_dtype != self.routing.train_dtype
        self.needs_shadow = p.needs_shadow or router_gap
        """The shadow forward runs when its precision (or, MoE, its router precision) differs."""
        self.shadow_optional = cfg.loss_fn.ratio == "train" and self.replay != "R2"
        """The loss does not read the shadow (only its metrics do): sampled by ``grpo.diagnostics_every``."""
        self.diagnose, self.shadow_sampled_out = True, False
        self.nonfinite: list = []
        """This step's non-finite log-probs, as messages (filled once the ranks agree the step is skipped)."""
        self._nonfinite_counts: list = []
        """``(what, count)`` per sanitized tensor; counts stay on device until ``run``'s one agreed flag."""
        self.plan_spec = plan_spec(model, cfg)
        self.plan: Optional[List[MicroBatch]] = None
        """This step's micro-batches (``make_plan``), shared by every forward of the step."""
        self.packing_cost_logged = False
        """``log_packing_cost`` has said that packed rows compute more attention scores than padding (once)."""

    def make_plan(self, packed: PackedBatch, equalise: bool = True) -> List[MicroBatch]:
        """The micro-batches of ``packed`` (padded, token-budget or packed rows); with ``equalise``
        every DP rank gets the same number (Megatron's training schedule: the largest micro-batches
        are split; a collective over DP). Forward-only passes outside a step need not agree, except
        under expert parallelism: there every rank's micro-batch ``k`` also gets one shape (the
        allgather dispatcher gathers equal token counts over EP), and passes always agree."""
        plan = self._build_plan(packed, equalise)
        if self.plan_spec.packing and not self.plan_spec.thd and not self.packing_cost_logged:
            self.packing_cost_logged = log_packing_cost(plan, tuple(packed.input_ids.shape))
        return plan

    def _build_plan(self, packed: PackedBatch, equalise: bool) -> List[MicroBatch]:
        spec = self.plan_spec
        if spec.max_tokens is None and not spec.packing:
            return build_plan(packed.input_ids, packed.labels, packed.mask, spec)
        groups = plan_groups(packed.mask, spec)
        config = unwrap(model_chunks(self.model)[0]).config
        expert_parallel = self.routing is not None and config.expert_model_parallel_size > 1
        if not (equalise or expert_parallel) or comm.group_size(self.dp_group) == 1:
            return build_plan(packed.input_ids, packed.labels, packed.mask, spec, groups)
        device = comm.collective_device(packed.mask.device, self.dp_group)
        count = torch.tensor(float(len(groups)), device=device)
        groups = split_to_count(groups, int(comm.all_reduce_max(count, self.dp_group).item()))
        shapes = None
        if expert_parallel:
            local = plan_shapes(groups, needed_lengths(packed.mask), spec, packed.input_ids.shape[1])
            shapes = comm.all_reduce_max(torch.tensor(local, device=device), self.dp_group).tolist()
        return build_plan(packed.input_ids, packed.labels, packed.mask, spec, groups, shapes)

    def score_layout(self, lengths: Sequence[int], packed: PackedBatch):
        """(this rank's rows, their micro-batches) of a whole step's ``packed`` sequences, exactly as
        ``build_step_batch`` and ``run`` lay the step out: the megatron generator scores its rollouts
        with them, so its log-probs are the trainer's bit for bit under packing and token budgets too."""
        rows = step_rows(lengths, comm.group_rank(self.dp_group), comm.group_size(self.dp_group),
                         self.plan_spec.balances_tokens)
        return rows, self.make_plan(packed.rows(rows).to(model_device(self.model)))

    def lowp_log_probs(self, packed: PackedBatch, dtype: Optional[torch.dtype] = None,
                       routes: Optional[torch.Tensor] = None, temperature: Optional[float] = None) -> torch.Tensor:
        """No-grad log-probs at the current weights in the shadow (or given) dtype and, MoE, with
        the generator's router precision (replaying ``routes`` when given); at the generation
        temperature unless ``temperature`` is given."""
        temperature = self.cfg.generation.temperature if temperature is None else temperature
        plan = self._plan_of(packed)
        with self._routes(shadow=True, targets=routes, plan=plan):
            return forward_log_probs(self.model, packed, compute_dtype=dtype or self.shadow_dtype,
                                     params_dtype=self.params_dtype, temperature=temperature,
                                     tp_group=self.tp_group, plan=plan)

    def _routes(self, shadow: bool, targets: Optional[torch.Tensor] = None, plan=None):
        """Routing control of forwards over ``plan``'s micro-batches (MoE; nothing for a dense model)."""
        if self.routing is None:
            return contextlib.nullcontext()
        return self.routing.forward(shadow, targets, plan)

    def run(self, batch: StepBatch, step: int = 0) -> Tuple[StatSet, Dict[str, torch.Tensor]]:
        """Shadow forward -> forward-backward -> optimizer step -> deployed-improvement probe.

        A step whose log-probs are non-finite on any rank is skipped (no update) and counted.
        """
        self.current_step, self.nonfinite, self._nonfinite_counts = step, [], []
        self.diagnose = diagnostics_due(step, self.cfg.grpo.diagnostics_every, self.cfg.logger.token_dump_steps)
        self.shadow_sampled_out = self.shadow_optional and not self.diagnose
        """A step without diagnostics: no shadow, so no metric made from it (absent, not zero)."""
        device = model_device(self.model)
        batch = batch.to(device)
        self.plan = self.make_plan(batch.packed)
        try:
            return self._run(batch, step, device)
        finally:
            self.plan = None

    def _run(self, batch: StepBatch, step: int, device) -> Tuple[StatSet, Dict[str, torch.Tensor]]:
        shadow, shadow_routes, self.replay_routes = self._shadow_forward(batch)
        ref = self._ref_log_probs(batch.packed)
        shadow = None if shadow is None else self._sanitize(shadow, batch.old_log_probs, batch.packed.mask, "shadow")
        ref = None if ref is None else self._sanitize(ref, batch.old_log_probs, batch.packed.mask, "reference")
        center = self.weight_center(batch, shadow)
        self.optimizer.zero_grad()
        stats, train_lp = self.forward_backward(batch, shadow, ref, self.replay_routes, center)
        if self.shadow_sampled_out:
            stats.discard(*SHADOW_STATS)
        elif self.routing is not None:
            self._routing_stats(stats, batch, train_lp, shadow, shadow_routes)
        self.last_log_probs = (train_lp, shadow if shadow is not None else train_lp)
        if self._skip_nonfinite(device):
            self.optimizer.zero_grad()
            extra = {"train/grad_norm": torch.full((), float("nan"), device=device),
                     "train/skipped_nonfinite": torch.ones((), device=device),
                     "train/skipped_overflow": torch.zeros((), device=device)}
        else:
            every = self.cfg.grpo.grad_cos_clean_every
            cos = self.cos_clean(batch) if every and step % every == 0 else None
            extra = self.optimizer.step()
            if cos is not None:
                extra["grad/cos_clean"] = cos
        extra["train/loss_scale"] = torch.tensor(self.optimizer.loss_scale(), device=device)
        if self.cfg.grpo.deployed_improvement and self.diagnose:
            before = shadow if shadow is not None else train_lp
            after = self.lowp_log_probs(batch.packed)
            adv = batch.advantages.unsqueeze(-1).expand_as(after)
            stats.add_sum("deployed", masked_sum((after - before).double() * torch.sign(adv).double(), batch.packed.mask))
        return stats, extra

    def cos_clean(self, batch: StepBatch) -> torch.Tensor:
        """Cosine between the actual (reduced) gradient and the clean REINFORCE gradient
        -(A * logp * mask).sum() / num_tokens (same routing replay), run through the same schedule
        and reduction; leaves the actual gradient in DDP's buffers."""
        params = self.optimizer.params
        actual = [p.main_grad.clone() for p in params]
        self.optimizer.zero_grad()

        def clean_loss(mb, logits):
            lp = mb.unpack(log_probs_from_logits(logits, mb.labels, self.cfg.generation.temperature,
                                                 self.tp_group, self.cfg.policy.logprob_chunk_size))
            mask = batch.packed.mask[mb.seqs]
            adv = batch.advantages[mb.seqs].unsqueeze(-1).to(lp.dtype)
            return -(adv * lp * mask).sum() / batch.num_global_tokens.to(lp.dtype), mask.sum(), {}

        self._schedule(batch, clean_loss, self.replay_routes)
        cos = grad_utils.gradient_cosine(params, actual)
        for p, g in zip(params, actual):
            p.main_grad.copy_(g)
        return cos

    def weight_center(self, batch: StepBatch, shadow) -> Optional[torch.Tensor]:
        """``detach_center``'s mu_W over the whole global batch, before the schedule; None for the other
        variants. ``loss.policy.weight_center`` gets exactly what the loss gets (the trainer's log-probs,
        sanitized, and ``_loss_shadow``), so it centres on the loss's own ratio whatever the source. The
        trainer's log-probs come from a no-grad pre-pass of the training forward (same precision, plan and
        routing replay), unless a shadow forward ran and the ratio's value does not read them."""
        if not getattr(clips.get_clip_variant(self.cfg.loss_fn.clip), "needs_center", False):
            return None
        if shadow is not None and not ratios.value_reads_log_probs(self.cfg.loss_fn.ratio):
            lp = shadow  # a stand-in: the ratio's value is the same whatever the trainer's log-probs
        else:
            plan = self._plan_of(batch.packed)
            with self._routes(shadow=False, targets=self.replay_routes, plan=plan):
                lp = forward_log_probs(self.model, batch.packed, compute_dtype=self.compute_dtype,
                                       params_dtype=self.params_dtype, temperature=self.cfg.generation.temperature,
                                       tp_group=self.tp_group, plan=plan)
            lp = self._sanitize(lp, batch.old_log_probs, batch.packed.mask, "the detach_center pre-pass")
        return weight_center(lp, batch.old_log_probs, batch.advantages, batch.packed.mask, self.loss_cfg,
                             shadow_log_probs=self._loss_shadow(shadow, slice(None), lp), dp_group=self.dp_group)

    def _ref_log_probs(self, packed: PackedBatch) -> Optional[torch.Tensor]:
        if self.ref_model is None:
            return None
        return forward_log_probs(self.ref_model, packed, compute_dtype=self.compute_dtype,
                                 params_dtype=self.params_dtype, temperature=self.cfg.generation.temperature,
                                 tp_group=self.tp_group, plan=self._plan_of(packed))

    def _plan_of(self, packed: PackedBatch) -> List[MicroBatch]:
        return self.plan if self.plan is not None else self.make_plan(packed.to(model_device(self.model)), equalise=False)

    def _shadow_forward(self, batch: StepBatch):
        """Shadow log-probs (None when skipped), the shadow's routing, and the routing the
        training forward replays (R2: the shadow's; R3: the generator's; else None)."""
        generator_routes = self._generator_routes(batch)
        if not self.needs_shadow or self.shadow_sampled_out:
            return None, None, generator_routes
        shadow = self.lowp_log_probs(batch.packed, routes=generator_routes)
        if self.routing is None:
            return shadow, None, None
        shadow_routes = self.routing.take(batch.packed.input_ids.shape[1])
        return shadow, shadow_routes, {"R2": shadow_routes, "R3": generator_routes}.get(self.replay)

    def _generator_routes(self, batch: StepBatch) -> Optional[torch.Tensor]:
        if self.replay != "R3":
            return None
        if batch.routes is None:
            raise ValueError("policy.megatron_cfg.moe_routing_replay=R3: the rollouts carry no routed experts")
        return select_layers(batch.routes, self.routing.layer_numbers)

    def _routing_stats(self, stats: StatSet, batch: StepBatch, train_lp, shadow, shadow_routes) -> None:
        """Routing agreement of the training forward with the shadow's (the generator's) routing, over
        every MoE layer (each stage's, summed over the pipeline group)."""
        used, natural = self.train_routes
        reference = shadow_routes if shadow_routes is not None else used
        beta = train_lp - shadow if shadow is not None else torch.zeros_like(train_lp)
        routing_stats(stats, used, natural, reference, beta, batch.packed.mask, sum_stages=comm.pipeline_sum)

    def forward_backward(self, batch: StepBatch, shadow, ref, replay=None, center=None) -> Tuple[StatSet, torch.Tensor]:
        """The policy loss through Megatron's schedule over micro-batches (MoE: replaying ``replay``
        routing when given); returns merged stats and the trainer's log-probs."""
        stats = StatSet()
        log_probs = torch.zeros(batch.packed.labels.shape, dtype=torch.float32, device=batch.packed.labels.device)
        ran = []

        def loss_func(mb, logits):
            lp = mb.unpack(log_probs_from_logits(logits, mb.labels, self.cfg.generation.temperature,
                                                 self.tp_group, self.cfg.policy.logprob_chunk_size))
            rows = mb.seqs
            mask = batch.packed.mask[rows]
            lp = faults.maybe_nan(self.current_step, mb.index, lp, mask)
            lp = self._sanitize(lp, batch.old_log_probs[rows], mask, f"micro-batch {mb.index}")
            loss, s = policy_loss_stats(
                lp, batch.old_log_probs[rows], batch.advantages[rows], mask, self.loss_cfg,
                shadow_log_probs=self._loss_shadow(shadow, rows, lp),
                ref_log_probs=ref[rows] if ref is not None else None, num_global_tokens=batch.num_global_tokens,
                num_global_seqs=batch.num_global_seqs, weight_center=center, dp_group=self.dp_group)
            stats.merge(s)
            log_probs[rows] = lp.detach()
            ran.append(True)
            return loss, mask.sum(), {}

        self._schedule(batch, loss_func, replay, record_routes=True)
        # pipeline parallelism: the loss ran on the last stage; every stage gets its stats and log-probs
        stats = stats.from_last_stage(batch.packed.labels.device)
        return stats, comm.tensor_from_last_stage(log_probs if ran else None, batch.packed.labels.shape,
                                                  torch.float32, batch.packed.labels.device)

    def _loss_shadow(self, shadow, rows, lp: torch.Tensor) -> Optional[torch.Tensor]:
        """The shadow log-probs the loss gets for ``rows``: without a shadow forward the trainer's own
        (beta = 0 exactly), or none on a step without diagnostics (no precision / phantom statistics)."""
        if shadow is not None:
            return shadow[rows]
        return None if self.shadow_sampled_out else lp.detach()

    def _schedule(self, batch: StepBatch, loss_func, replay, record_routes: bool = False) -> None:
        """One forward-backward of ``loss_func(rows, logits)`` over the batch's micro-batches in
        Megatron's schedule; gradients land reduced in DDP's buffers (``finalize_model_grads``)."""
        seq_len = batch.packed.input_ids.shape[1]
        plan = self._plan_of(batch.packed)

        def forward_step(data_iterator, model):
            mb = next(data_iterator)
            inputs = dict(mb.model_inputs(), padding_mask=mb.padding_mask if mask_padding else None)
            with precision_context(self.compute_dtype, self.params_dtype):
                logits = forward_logits(model, mb.input_ids, **inputs)
            return logits, functools.partial(loss_func, mb)

        mask_padding = self._scale_moe_aux_losses(plan)
        mb_rows, mb_width = plan[0].input_ids.shape
        with self._routes(shadow=False, targets=replay, plan=plan), pipeline_dtype(self.model, self.compute_dtype, self.params_dtype):
            get_forward_backward_func()(
                forward_step_func=forward_step, data_iterator=plan_iterators(plan, self.model), model=self.model,
                num_microbatches=len(plan), seq_length=mb_width, micro_batch_size=mb_rows, forward_only=False)
            if record_routes and self.routing is not None:
                self.train_routes = (self.routing.take(seq_len, "used"), self.routing.take(seq_len, "natural"))

    def _scale_moe_aux_losses(self, plan: Sequence[MicroBatch]) -> bool:
        """MoE aux/z losses as a mean over the step's routed tokens, counted over DP (a collective,
        when a coefficient is on); returns whether the routers get the plan's ``padding_mask``.
        Without the aux loss they do, and the routed tokens are each sequence's needed tokens, the
        same in every plan (packed == padded; the positions ``forward_logits`` pads a row with under
        SP are padding). With it (padded plans only: ``PolicyConfig``) they do not, and every token the
        routers see counts: rows x the width each micro-batch is forwarded at, rounded up to
        ``sequence_multiple`` (those padding positions are routed too); Megatron's masked aux loss
        weights each sequence-parallel shard by its own valid-token count, which would break TP
        invariance. Under ``calculate_per_token_loss`` Megatron multiplies the losses by a token count
        (a TP rank's share of the tokens under SP; on 0.19 times the TP x CP size: ``compat.megatron``)
        and leaves the division by the global count to ``finalize_model_grads``; our losses are
        already global means, so the coefficients carry that division instead."""
        config = unwrap(model_chunks(self.model)[0]).config
        m = self.cfg.policy.megatron_cfg
        mask_padding = not m.moe_aux_loss_coeff
        if not getattr(config, "num_moe_experts", None) or not (m.moe_aux_loss_coeff or m.moe_z_loss_coeff):
            return mask_padding
        k = sequence_multiple(config)
        if mask_padding:
            routed = torch.stack([(~mb.padding_mask).sum() for mb in plan]).sum().double()
        else:  # rows x the width forwarded: forward_logits pads it to the sequence multiple
            routed = torch.tensor(float(sum(r * (w + -w % k) for r, w in (mb.padding_mask.shape for mb in plan))),
                                  dtype=torch.float64)
        routed = routed.to(comm.collective_device(routed.device, self.dp_group))
        num_routed_tokens = max(float(comm.all_reduce_sum(routed, self.dp_group).item()), 1.0)  # one host sync
        tp_cp_size = ps.get_tensor_model_parallel_world_size() * ps.get_context_parallel_world_size()
        num_routed_tokens = moe_aux_loss_token_multiplier(num_routed_tokens / k, tp_cp_size)
        config.moe_aux_loss_coeff = m.moe_aux_loss_coeff / num_routed_tokens
        config.moe_z_loss_coeff = m.moe_z_loss_coeff / num_routed_tokens if m.moe_z_loss_coeff else None
        return mask_padding

    def _sanitize(self, lp: torch.Tensor, fallback: torch.Tensor, mask: torch.Tensor, what: str) -> torch.Tensor:
        """Replaces non-finite log-probs by ``fallback`` and counts those at valid tokens (the step will be
        skipped, agreed across ranks), so that every rank still runs the same collectives. The count
        stays on device: ``_skip_nonfinite`` reads every count of the step with one host sync."""
        finite = torch.isfinite(lp)
        self._nonfinite_counts.append((what, (~finite & mask).sum()))
        return torch.where(finite, lp, fallback)

    def _skip_nonfinite(self, device) -> bool:
        """Whether any rank saw a non-finite log-prob this step (one collective, one host sync); when so,
        ``self.nonfinite`` names this rank's culprits."""
        names = [what for what, _ in self._nonfinite_counts]
        counts = (torch.stack([count for _, count in self._nonfinite_counts]) if names
                  else torch.zeros(1, dtype=torch.long, device=device))
        flag = (counts.sum() > 0).float().to(comm.collective_device(device))
        if not comm.all_reduce_max(flag, comm.world_group()).item():
            return False
        self.nonfinite = [f"log_probs of {what}: {n} non-finite values at valid tokens"
                          for what, n in zip(names, counts.tolist()) if n]
        return True


def diagnostics_due(step: int, every: int, dump_steps=()) -> bool:
    """``grpo.diagnostics_every``: the shadow forward (where optional) and the deployed-improvement
    probe run at step 1, every ``every``-th step, and at the token-dump steps (their dumps need the shadow)."""
    return step == 1 or step % every == 0 or step in dump_steps


def plan_spec(model, cfg: Config) -> PlanSpec:
    """``policy.sequence_packing`` / ``policy.dynamic_batching`` / ``train_micro_batch_size`` as a
    ``PlanSpec`` for ``model`` (row widths a multiple of 8 and of TP under SP; one row length
    under PP; THD ``PackedSeqParams`` where the Transformer Engine spec is active)."""
    p, config = cfg.policy, unwrap(model_chunks(model)[0]).config
    packing, dynamic = p.sequence_packing.enabled, p.dynamic_batching.enabled  # exclusive (config/schema.py)
    budget = (p.sequence_packing.train_mb_tokens or None) if packing else \
        (p.dynamic_batching.max_tokens_per_microbatch if dynamic else None)
    multiple = 8 * sequence_multiple(config)
    return PlanSpec(micro_batch_size=p.train_micro_batch_size, max_tokens=budget, packing=packing, multiple=multiple,
                    fixed_width=config.pipeline_model_parallel_size > 1, thd=packing and uses_te_attention(model),
                    count_multiple=config.pipeline_model_parallel_size if len(model_chunks(model)) > 1 else 1)


def uses_te_attention(model) -> bool:
    """Whether the model's core attention is Transformer Engine's (THD packing) rather than the
    local ``DotProductAttention`` (block-diagonal mask)."""
    layers = unwrap(model_chunks(model)[0]).decoder.layers
    return len(layers) > 0 and not isinstance(layers[0].self_attention.core_attention, DotProductAttention)


def make_routing(model, cfg: Config):
    """The MoE ``Routing`` control of ``model`` (None for a dense model)."""
    m, p = cfg.policy.megatron_cfg, cfg.policy.precision
    if not getattr(unwrap(model_chunks(model)[0]).config, "num_moe_experts", None):
        if m.moe_routing_replay != "none":
            raise ValueError(f"policy.megatron_cfg.moe_routing_replay={m.moe_routing_replay} needs a MoE model; "
                             f"policy.model_name is dense")
        return None
    train_dtype = {"fp32": torch.float32, "fp64": torch.float64}[m.moe_router_dtype]
    return Routing(model, train_dtype, to_dtype(p.shadow_router_dtype))


def rollout_metrics(rollouts: Rollouts, rewards: torch.Tensor, device=None) -> Dict[str, torch.Tensor]:
    """Reward and length metrics (identical on every rank: rollouts are broadcast), on ``device``."""
    lengths = torch.tensor([len(r.completion_ids) for r in rollouts], dtype=torch.float32, device=device)
    rewards = rewards.to(device)
    eos = sum(r.finish_reason == "stop" for r in rollouts) / len(rollouts)
    return {"reward/mean": rewards.mean(), "reward/std": rewards.std(unbiased=False),
            "completion/length_mean": lengths.mean(), "completion/eos_fraction": torch.tensor(eos, device=device)}
