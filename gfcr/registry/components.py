"""The extension points of the update's components, declared in one place: what ``update.grpo``
and ``gfcr validate`` call or read on an advantage estimator, a loss, an aggregation or an
off-policy correction beyond its kind's required methods, and how a class's are read.

- ``requires`` (any kind): a ClassVar of ``Requirement``s on the other components, which
  ``gfcr validate`` checks;
- ``pairing_problems(config, ctx)`` (any kind; ``ChecksPairing``): a staticmethod that checks
  the component's Config against the others and the pipeline, in ``gfcr validate``;
- ``estimate_batch(groups, pool)`` (advantage; ``EstimatesBatch``): called instead of
  ``estimate`` when the estimator needs the whole batch or the prompts;
- ``token_corrections`` (loss): a ClassVar bool, default True: the loss has a per-token ratio
  that an off-policy correction may reweight (False refuses every correction that does);
- ``needs_logprobs`` (loss): a ClassVar bool, default False: ``terms`` also takes ``logprobs=``;
- ``parameters(device)`` (aggregation; ``LearnsParameters``): param groups for the AdamW;
- ``batch_term(plan)`` (aggregation; ``AddsBatchTerm``): a loss term added once per step;
- ``metrics()`` (aggregation; ``ReportsStepMetrics``): numbers added to the update's metrics;
- ``state_dict()`` and ``load_state_dict(state)`` (aggregation; ``gfcr.registry.Stateful``);
- ``correct(logp, behaviour, stale)`` (correction; ``CorrectsTokens``): the off-policy path,
  the ratio against a proximal policy and a per-token weight;
- ``keeps(rollout, version)`` (correction; ``LimitsStaleness``): the staleness limit;
- ``attach(model)``, ``proximal_model()``, ``correct_with(logp, behaviour, stale, proximal)`` and
  ``follow(model)`` (correction; ``KeepsProximalPolicy``): a proximal policy of the correction's
  own (PPO-EWMA's moving average of the weights), scored by the update on every micro-batch and
  moved after every optimizer step;
- ``correct_sequences(logp, behaviour, stale, weight)`` (correction; ``CorrectsSequences``): the
  off-policy path for a correction that needs each response's counted tokens (``weight``, the
  ``[B, R]`` token weights; verl's sequence-level importance sampling);
- ``refine_group(rewards, sq_grad_norms, log_seq_weights, lengths)`` (advantage;
  ``WeighsByGradients``): advantages that need each trajectory's own gradient (VCPO's OPOB
  baseline), which the update computes before its backward pass.

The required methods are ``estimate`` (advantage), ``terms`` (loss), ``plan`` and ``reduce``
(aggregation), ``sums`` and ``factor`` (learning-rate rule); a correction has none (``none`` is a
correction with nothing to do).

A role is read with ``provides(component, Role)`` and a flag with ``declared(component,
name)``, never with ``getattr(component, "<name>", default)``: registration refuses a public
name that is a near miss of one of these (``token_correction``, ``estimate_batches``,
``requieres``), which the update would otherwise silently never read.

Parameters are typed loosely (``Any``): this layer imports neither torch nor ``gfcr.stages``;
the records (``Requirement``, ``TokenCorrection``) live with the components in
``gfcr.stages.components``.
"""

from __future__ import annotations

from typing import Any, Protocol, Sequence, runtime_checkable

from gfcr.registry.lifecycle import PipelineProblem, Stateful, refuse_near_misses


@runtime_checkable
class ChecksPairing(Protocol):
    """A staticmethod ``pairing_problems(config, ctx) -> [problem]``: what the component's Config
    needs of the other components and the pipeline (``ctx``: ``gfcr.stages.components.base.PairingContext``;
    keys relative to the update's ``with``)."""

    @staticmethod
    def pairing_problems(config: Any, ctx: Any) -> Sequence[PipelineProblem]: ...


@runtime_checkable
class EstimatesBatch(Protocol):
    """An estimator that needs the whole batch or the prompts (REINFORCE++, PVPO)."""

    def estimate_batch(self, groups: Sequence[Any], pool: Any) -> list[Any]: ...


@runtime_checkable
class LearnsParameters(Protocol):
    """Optimizer param groups (``{"params": [...]}``, optionally ``"lr"``) the update's AdamW adds."""

    def parameters(self, device: Any) -> list[dict[str, Any]]: ...


@runtime_checkable
class AddsBatchTerm(Protocol):
    """A loss term added once per step (DARO's ``-ln w``), or None."""

    def batch_term(self, plan: Any) -> Any: ...


@runtime_checkable
class ReportsStepMetrics(Protocol):
    """Numbers added to the update's metrics after each step (learned weights)."""

    def metrics(self) -> dict[str, float]: ...


@runtime_checkable
class CorrectsTokens(Protocol):
    """An off-policy correction of every token's ratio and loss weight: ``correct(logp, behaviour,
    stale)`` with ``[B, R]`` tensors returns a ``TokenCorrection``; the update then takes the
    ratio against its ``proximal`` log-probs and reports the IS diagnostics."""

    def correct(self, logp: Any, behaviour: Any, stale: Any) -> Any: ...


@runtime_checkable
class LimitsStaleness(Protocol):
    """``keeps(rollout, version)``: the ``[T]`` weights of the rollout's tokens, None for all 1: a bool
    mask (the staleness limit keeps the True ones) or floats in [0, 1] (``freshness``), which
    multiply the tokens' loss weights and the aggregation's denominator."""

    def keeps(self, rollout: Any, version: int) -> Any: ...


@runtime_checkable
class KeepsProximalPolicy(Protocol):
    """A correction with a proximal policy of its own (PPO-EWMA): ``attach(model)`` once the policy
    is lent, ``proximal_model()`` the model the update scores every micro-batch with (no gradient),
    ``correct_with(logp, behaviour, stale, proximal)`` the ``TokenCorrection`` against those
    log-probs, and ``follow(model)`` after every optimizer step."""

    def attach(self, model: Any) -> None: ...

    def proximal_model(self) -> Any: ...

    def correct_with(self, logp: Any, behaviour: Any, stale: Any, proximal: Any) -> Any: ...

    def follow(self, model: Any) -> None: ...


@runtime_checkable
class CorrectsSequences(Protocol):
    """An off-policy correction that needs each response's counted tokens: ``correct_sequences(logp,
    behaviour, stale, weight)`` with ``[B, R]`` tensors (``weight`` the token weights, 0 on padding
    and masked tokens) returns a ``TokenCorrection``, as ``CorrectsTokens`` does."""

    def correct_sequences(self, logp: Any, behaviour: Any, stale: Any, weight: Any) -> Any: ...


@runtime_checkable
class WeighsByGradients(Protocol):
    """An estimator whose advantages need each trajectory's gradient (VCPO's OPOB baseline):
    ``refine_group(rewards, sq_grad_norms, log_seq_weights, lengths)``, ``[G]`` float64 arrays of
    one group's rollouts that enter the backward pass, gives their advantages. ``estimate`` then
    gives the stand-in the batch is planned with."""

    def refine_group(self, rewards: Any, sq_grad_norms: Any, log_seq_weights: Any, lengths: Any) -> Any: ...


METHODS: dict[type, tuple[str, ...]] = {
    ChecksPairing: ("pairing_problems",), EstimatesBatch: ("estimate_batch",), LearnsParameters: ("parameters",),
    AddsBatchTerm: ("batch_term",), ReportsStepMetrics: ("metrics",), Stateful: ("state_dict", "load_state_dict"),
    CorrectsTokens: ("correct",), LimitsStaleness: ("keeps",),
    KeepsProximalPolicy: ("attach", "proximal_model", "correct_with", "follow"), WeighsByGradients: ("refine_group",),
    CorrectsSequences: ("correct_sequences",),
}
FLAGS: dict[str, Any] = {"requires": (), "token_corrections": True, "needs_logprobs": False}
REQUIRED: dict[str, tuple[str, ...]] = {"advantage": ("estimate",), "loss": ("terms",),
                                        "aggregation": ("plan", "reduce"), "correction": (),
                                        "lr_rule": ("sums", "factor")}
EXTENSION_NAMES: frozenset[str] = frozenset(
    [m for names in METHODS.values() for m in names] + list(FLAGS) + [m for ms in REQUIRED.values() for m in ms])


def provides(component: Any, role: type) -> bool:
    """Whether ``component`` (a class or an instance) has the role's methods."""
    return all(callable(getattr(component, m, None)) for m in METHODS[role])


def declared(component: Any, flag: str) -> Any:
    """The value ``component`` (a class or an instance) declares for ``flag``, or the flag's
    default; KeyError for a name that is not a declared flag."""
    return getattr(component, flag, FLAGS[flag])


def _public_names(cls: type) -> list[str]:
    """Public attributes the class (not ``object``) defines, nested classes (``Config``) excluded."""
    names = [name for klass in cls.__mro__ if klass is not object for name, value in vars(klass).items()
             if not name.startswith("_") and not isinstance(value, type)]
    return list(dict.fromkeys(names))


def check_component_names(kind: str, alias: str, cls: type) -> None:
    """RegistryError naming the first public name of ``cls`` that is a near miss of an extension point."""
    refuse_near_misses(_public_names(cls), EXTENSION_NAMES,
                       f"{kind} `{alias}` ({cls.__qualname__}) defines `{{name}}`, which is not an extension point "
                       "of the update's components: the update would never read it")
