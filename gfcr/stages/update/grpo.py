"""update.grpo: the GRPO-family policy update (PPO-clip against the behaviour policy).

For every included group, an advantage estimator turns the group's rewards into one
advantage per rollout (``mean_std`` for GRPO, ``mean``, ``median`` for MC-GRPO, ``gapo``;
see ``gfcr.stages.update.advantages``), scaled by the group's and the rollout's sample
weight. The loss is the token-level clipped surrogate

    ratio_t = exp(log pi_theta(y_t) - log mu(y_t))
    l_t     = -min(ratio_t * A, clip(ratio_t, 1 - eps_low, 1 + eps_high) * A) + beta * KL_t

with ``mu`` the behaviour log-probabilities the engine recorded, asymmetric clipping
(DAPO's clip-higher: ``clip: [0.2, 0.28]``), and an optional KL to a frozen copy of the
initial policy (the k3 estimator, as GRPO). Aggregation is ``token_mean`` (the sum over
every response token of the batch divided by their count, DAPO) or ``seq_mean`` (each
response's token mean, averaged over responses, GRPO). One AdamW step per call, with
gradient-norm clipping, over micro-batches whose gradients accumulate.

Logits are computed only at response positions (``logits_to_keep``), and rollouts whose
advantage is exactly zero (with no KL term) never enter the forward or backward pass: their
loss and gradient are zero, and they still count in the aggregation's denominator, so the
gradient is unchanged (a test checks this). An empty batch, or one whose advantages are all
zero, skips the update; a NaN or infinite loss or gradient norm skips it too (the reason is
reported) and the run goes on.

Deviations:
- one optimizer step per batch (no PPO epochs or mini-batches yet), so on fresh rollouts
  the ratio is 1 up to numerics; the ratio is taken against the engine's behaviour
  log-probabilities, not against recomputed ``pi_old`` log-probabilities;
- the sample weights of Prompt-GDRO-style stages multiply the advantage;
- position ids follow the attention mask (left-padded prompts), as generation does; TRL
  and the peer hand loop do not pass them.

Example (one update of the ``tiny-arith`` policy on a hand-scored group):

>>> from gfcr.engines import TransformersEngine, load_policy
>>> from gfcr.records import Allocation, AllocationEntry, Prompt, PromptPool, RolloutGroups
>>> from gfcr.spec import PolicySpec
>>> from gfcr.stages.generate.sample import Sample
>>> from gfcr.stages.resources import Resources
>>> policy = load_policy(PolicySpec(model="tiny-arith"))
>>> resources = Resources(policy, TransformersEngine(policy))
>>> prompt = Prompt("a:0", text="What is 12 + 30? Answer:")
>>> sample, update = Sample(Sample.Config(max_new_tokens=8)), GRPOUpdate(GRPOUpdate.Config(lr=1e-3))
>>> sample.setup(resources); update.setup(resources)
>>> groups = sample.run(Allocation(0, (AllocationEntry(prompt, 4),)))
>>> for i, r in enumerate(groups.rollouts()):
...     r.reward = float(i % 2)
>>> report = update.run(groups, PromptPool([prompt]))
>>> report.policy_version, report.rollouts_in_update, report.skipped
(1, 4, False)

YAML:

.. code-block:: yaml

    update: {use: update.grpo, from: keep, with: {lr: 1.0e-4, clip: [0.2, 0.28], advantage: mean_std}}
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Annotated, Any, Literal

import numpy as np
from pydantic import Field

from gfcr.records import PromptPool, Rollout, RolloutGroups, UpdateReport
from gfcr.registry import StageConfig
from gfcr.stages.resources import Policy, Resources, prompt_tokens
from gfcr.stages.update.advantages import Estimator, group_advantages


@dataclass
class _Item:
    """One rollout of the batch, ready for the forward pass."""

    prompt_ids: list[int]
    rollout: Rollout
    advantage: float


class GRPOUpdate:
    """Clipped-surrogate policy update with a typed advantage estimator."""

    class Config(StageConfig):
        lr: Annotated[float, Field(gt=0.0, description="AdamW learning rate (constant)")] = 1e-6
        clip: tuple[Annotated[float, Field(ge=0.0)], Annotated[float, Field(ge=0.0)]] = Field(
            (0.2, 0.2), description="(eps_low, eps_high) of the ratio clip; [0.2, 0.28] is DAPO's clip-higher")
        advantage: Estimator = Field("mean_std", description="group baseline: mean_std | mean | median | gapo")
        mad_scale: bool = Field(False, description="median: divide by MAD + 1e-3 (MC-GRPO code; off by default)")
        gapo_fraction: Annotated[float, Field(gt=0.0, le=1.0)] = 0.5
        loss_agg: Literal["token_mean", "seq_mean"] = "token_mean"
        kl_coef: Annotated[float, Field(ge=0.0, description="weight of the k3 KL to the initial policy")] = 0.0
        max_grad_norm: Annotated[float, Field(gt=0.0)] | None = 1.0
        weight_decay: Annotated[float, Field(ge=0.0)] = 0.0
        betas: tuple[float, float] = (0.9, 0.999)
        adam_eps: Annotated[float, Field(gt=0.0)] = 1e-8
        micro_batch_size: Annotated[int, Field(ge=1, description="rollouts per forward/backward pass")] = 16
        temperature: Annotated[float, Field(gt=0.0, description="the sampling temperature (log-probs are tempered)")] = 1.0

    def __init__(self, config: Config):
        self.config = config
        self.policy: Policy | None = None
        self.resources: Resources | None = None
        self.optimizer: Any = None
        self.reference: Any = None

    def setup(self, resources: Resources) -> None:
        import torch

        cfg = self.config
        self.resources = resources
        self.policy = resources.require_policy("update.grpo")
        self.optimizer = torch.optim.AdamW(self.policy.model.parameters(), lr=cfg.lr, betas=cfg.betas,
                                           eps=cfg.adam_eps, weight_decay=cfg.weight_decay)
        if cfg.kl_coef > 0:
            self.reference = self.policy.reference()

    # --- the step -------------------------------------------------------------------------

    def run(self, groups: RolloutGroups, pool: PromptPool) -> UpdateReport:
        policy = self._policy()
        items, batch_groups, zero_var = self._batch(groups, pool)
        n_rollouts, n_tokens = len(items), sum(len(i.rollout) for i in items)
        metrics: dict[str, float] = {"batch_groups": batch_groups, "batch_rollouts": n_rollouts,
                                     "batch_tokens": n_tokens, "batch_zero_variance_groups": zero_var}
        forward = [i for i in items if len(i.rollout) and (i.advantage != 0.0 or self.config.kl_coef > 0)]
        if not forward:
            reason = "empty batch" if not items else "every advantage is zero"
            return UpdateReport(policy.version, skipped=True, skip_reason=reason, metrics=metrics)
        loss, stats = self.accumulate_gradients(forward, n_rollouts, n_tokens)
        metrics.update(stats)
        if not math.isfinite(loss):
            self.optimizer.zero_grad(set_to_none=True)
            return UpdateReport(policy.version, skipped=True, skip_reason=f"non-finite loss ({loss})",
                                loss=loss, metrics=metrics)
        grad_norm = self._clip_gradients()
        metrics["grad_norm"] = grad_norm
        if not math.isfinite(grad_norm):
            self.optimizer.zero_grad(set_to_none=True)
            return UpdateReport(policy.version, skipped=True, skip_reason=f"non-finite gradient norm ({grad_norm})",
                                loss=loss, metrics=metrics)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        policy.version += 1
        if self.resources is not None and self.resources.engine is not None:
            self.resources.engine.sync_weights(policy.version)
        return UpdateReport(policy.version, len(forward), sum(len(i.rollout) for i in forward), loss=loss,
                            metrics=metrics)

    def _policy(self) -> Policy:
        if self.policy is None:
            raise RuntimeError("update.grpo was not set up with a policy")
        return self.policy

    def _batch(self, groups: RolloutGroups, pool: PromptPool) -> tuple[list[_Item], int, int]:
        """Every rollout of the included groups, with its advantage written onto it."""
        cfg, policy, items = self.config, self._policy(), []
        included = [g for g in groups if g.verdict.included and g.rollouts]
        zero_var = 0
        for g in included:
            rewards = g.rewards
            if np.isnan(rewards).any():
                raise ValueError(f"group {g.group_id} has unscored rollouts; put a verifier stage "
                                 "(filter.verify) between generation and the update")
            zero_var += int(len(rewards) > 1 and np.ptp(rewards) == 0)
            advantages = group_advantages(rewards, cfg.advantage, mad_scale=cfg.mad_scale,
                                          gapo_fraction=cfg.gapo_fraction)
            prompt_ids = prompt_tokens(policy, pool.get(g.prompt_id))
            for r, a in zip(g.rollouts, advantages):
                r.advantage = float(a) * g.sample_weight * r.sample_weight
                items.append(_Item(r.context_token_ids or prompt_ids, r, r.advantage))
        return items, len(included), zero_var

    def accumulate_gradients(self, items: list[_Item], n_rollouts: int, n_tokens: int) -> tuple[float, dict[str, float]]:
        """Backward the loss of ``items`` in micro-batches; the denominators are the whole
        batch's (``n_rollouts`` responses, ``n_tokens`` tokens), so leaving out zero-advantage
        rollouts changes nothing. Returns the loss and diagnostics."""
        import torch

        cfg = self.config
        eps_low, eps_high = cfg.clip
        total, clipped, ratio_sum, kl_sum, counted = 0.0, 0.0, 0.0, 0.0, 0
        for start in range(0, len(items), cfg.micro_batch_size):
            chunk = items[start:start + cfg.micro_batch_size]
            logp, mask = response_logprobs(self._policy().model, chunk, cfg.temperature)  # [B, R]
            behaviour = _padded([i.rollout.behavior_logprobs for i in chunk], mask.shape[1])  # [B, R]
            behaviour = behaviour.to(logp.device)
            adv = torch.tensor([i.advantage for i in chunk], dtype=logp.dtype, device=logp.device)[:, None]  # [B, 1]
            ratio = torch.exp(logp - behaviour)
            surrogate = torch.min(ratio * adv, torch.clamp(ratio, 1 - eps_low, 1 + eps_high) * adv)
            per_token = -surrogate
            if self.reference is not None:
                with torch.no_grad():
                    ref, _ = response_logprobs(self.reference, chunk, cfg.temperature)
                kl = torch.exp(ref - logp) - (ref - logp) - 1
                per_token = per_token + cfg.kl_coef * kl
                kl_sum += float((kl.detach() * mask).sum())
            if cfg.loss_agg == "token_mean":
                loss = (per_token * mask).sum() / n_tokens
            else:
                loss = ((per_token * mask).sum(1) / mask.sum(1).clamp(min=1)).sum() / n_rollouts
            loss.backward()
            total += float(loss.detach())
            with torch.no_grad():
                outside = ((ratio < 1 - eps_low) | (ratio > 1 + eps_high)).float()
                clipped += float((outside * mask).sum())
                ratio_sum += float((ratio * mask).sum())
                counted += int(mask.sum())
        stats = {"loss": total, "clip_fraction": clipped / max(counted, 1), "ratio_mean": ratio_sum / max(counted, 1),
                 "advantage_abs_mean": float(np.mean([abs(i.advantage) for i in items]))}
        if self.reference is not None:
            stats["kl"] = kl_sum / max(counted, 1)
        return total, stats

    def _clip_gradients(self) -> float:
        import torch

        params = [p for p in self._policy().model.parameters() if p.grad is not None]
        if self.config.max_grad_norm is None:
            norms = [p.grad.detach().norm() for p in params]
            return float(torch.stack(norms).norm()) if norms else 0.0
        return float(torch.nn.utils.clip_grad_norm_(params, self.config.max_grad_norm))

    # --- state ----------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        return {"optimizer": self.optimizer.state_dict() if self.optimizer is not None else None}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("optimizer") is not None:
            self.optimizer.load_state_dict(state["optimizer"])


def response_logprobs(model: Any, items: list[_Item], temperature: float) -> tuple[Any, Any]:
    """log pi(y_t) at every response position: ``[B, R]`` log-probs and ``[B, R]`` mask.

    The batch is ``[left-padded prompt | right-padded response]``, and the model computes
    logits only for the last ``R + 1`` positions (the response's predictors)."""
    import torch

    prompts = [i.prompt_ids for i in items]
    responses = [i.rollout.response_token_ids for i in items]
    p_len, r_len = max(len(p) for p in prompts), max(len(r) for r in responses)
    ids = torch.zeros((len(items), p_len + r_len), dtype=torch.long)
    attention = torch.zeros_like(ids)
    for b, (p, r) in enumerate(zip(prompts, responses)):
        ids[b, p_len - len(p):p_len] = torch.tensor(p, dtype=torch.long)
        ids[b, p_len:p_len + len(r)] = torch.tensor(r, dtype=torch.long)
        attention[b, p_len - len(p):p_len + len(r)] = 1
    device = next(model.parameters()).device  # the policy trains on the GPU beside the vLLM engine
    ids, attention = ids.to(device), attention.to(device)
    positions = (attention.cumsum(1) - 1).clamp(min=0)
    logits = model(input_ids=ids, attention_mask=attention, position_ids=positions,
                   logits_to_keep=r_len + 1).logits[:, :-1, :].float()  # [B, R, V]
    if temperature != 1.0:
        logits = logits / temperature
    targets = ids[:, p_len:]  # [B, R]
    logp = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)
    mask = attention[:, p_len:].to(logp.dtype)
    return logp * mask, mask


def _padded(arrays: list[np.ndarray], width: int) -> Any:
    import torch

    out = torch.zeros((len(arrays), width), dtype=torch.float32)
    for b, a in enumerate(arrays):
        out[b, :len(a)] = torch.from_numpy(np.asarray(a, dtype=np.float32))
    return out
