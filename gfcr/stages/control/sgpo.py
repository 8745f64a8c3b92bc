"""control.sgpo: profile every prompt once under the initial policy, then never dispatch the
trivial ones, give each learnable one the group size ``G ~ 1/p0`` (2, 4 or 8) and train the
groups easy to hard, one group size per curriculum phase.

sGPO, sorted Group Policy Optimization (arXiv 2606.08854, Red Hat / IBM). No official code
was found; the rules and constants are those a third-party reimplementation
(``RohanAwhad/fast-rl-bench``, branch ``sGPO``: ``scripts/sgpo_profile.py``,
``sgpo_should_skip``, ``sgpo_group_size``) attributes to the paper's section 4.3, as our
research notes report them (not read here).

**Profiling** (in the first call, step 0, so under the initial policy): each profiled prompt
gets ``profile_samples`` (``N``, default 8) samples from the engine, scored by its verifier;
``p0 = successes / N``. The samples are not trained on, but they are charged to step 0's
``rollouts_generated`` and ``tokens_generated`` (``Lent.charge_generation``), so
budgets and ``gfcr compare`` count them, as the paper counts profiling in its compute.

**Labels** (persistent, never refreshed):

- ``trivial``: ``p0 > t`` (``trivial_above``, default 0.75): never dispatched;
- ``unsolved``: ``p0 = 0``: a seeded ``unsolved_rate`` share (default 10%) is kept, the
  rest never dispatched;
- ``learnable``: otherwise, with ``G`` the smallest of ``group_sizes`` (default 2, 4, 8) with
  ``G * p0 >= 1`` (a group expected to hold at least one success: ``1/p0`` rounded *up* to a
  bucket), the largest when none is. With ``N = 8``: ``p0 = 1/8 -> 8``, ``2/8 -> 4``,
  ``3/8 -> 4``, ``4/8 .. 6/8 -> 2``. Comparisons are exact (fractions), so the boundaries
  ``0.125, 0.25, 0.5, 0.75`` fall where the rules say.

**Curriculum**: phase ``k`` (``k = 0, 1, 2``) runs from step ``phase_steps[k - 1]`` (0 for the
first) and draws from the learnable prompts with ``G = group_sizes[k]`` plus the kept
unsolved ones, all dispatched with that ``G``: easy (large ``p0``, small groups) first, hard
last. Within a phase, ``batch_size`` prompts a call from a seeded permutation of the phase's
prompts, a new one each epoch (``control.uniform``'s ``drop_last`` rule; a phase with fewer
prompts than ``batch_size`` dispatches all of them). Each entry's ``n_rollouts`` is its
``G``: sGPO is the group-size allocator, so no ``control.fixed_n`` goes after it.

**Reasons** (the control lineage): a dispatched entry's ``ControlReason`` is its label
(``learnable`` or ``unsolved_kept``) with ``p0`` as the decisive number and ``successes``,
``samples``, ``group_size``, ``phase``. The prompts the labels drop for the whole run
(``trivial``: ``p0`` against ``trivial_above``; ``unsolved``: the seeded ``keep_draw`` was not
below ``unsolved_rate``) are listed once, as skipped entries (``n_rollouts = 0``) after the
dispatched ones in the call that profiled them; a learnable prompt waiting for its phase is
not listed (it was not skipped, only not yet due).

Per-step metrics go to ``controller_state`` (``control.<id>`` in ``metrics.jsonl`` and
MLflow): ``phase``, ``group_size``, ``phase_prompts``, ``epoch``, ``chosen``,
``predicted_success`` (mean ``p0`` of the chosen prompts), ``chosen_unsolved``, the label
counts (``trivial``, ``unsolved``, ``unsolved_kept``, ``learnable_g2`` ...), and
``profile_rollouts`` / ``profile_tokens`` (what the profile cost, in every line; the step that
ran it has them in its ``rollouts_generated`` / ``tokens_generated``).

Deviations:
- The paper trains each cluster to convergence (``SeqTrain``); here, as in the
  reimplementation, phases end at fixed steps (``phase_steps``, default 40 and 80: our
  choice for a ~100-step tiny-arith run).
- Bucketing rounds ``1/p0`` up onto the buckets (the research notes leave floor or ceil
  open); ``G`` never exceeds the largest bucket.
- Unsolved prompts are sub-sampled once, at profiling (a seeded per-prompt draw), not at
  each dispatch; the kept ones join every phase.
- A phase with no prompts is skipped (the next non-empty one runs); ``profile_prompts``
  profiles a seeded subset of the pool instead of all of it, and unprofiled prompts are never
  dispatched. The profile samples use this stage's ``temperature`` and ``max_new_tokens``
  (set them as the rollout stage's) and the engine's per-row seeding.

Fidelity: from the abstract: no public code from the authors (RohanAwhad/fast-rl-bench's sGPO
branch is a third-party version); the rules above are this stage's reading.

Example (a profile given by hand; a run profiles through the engine at step 0):

>>> from gfcr.records import Prompt, PromptPool, StepContext
>>> [bucket_group_size(s, 8) for s in (1, 2, 3, 4, 6)]  # p0 = 0.125, 0.25, 0.375, 0.5, 0.75
[8, 4, 4, 2, 2]
>>> [profile_label(s, 8, 0.75) for s in (0, 1, 6, 7)]
['unsolved', 'learnable', 'learnable', 'trivial']
>>> pool = PromptPool([Prompt(f"p:{i}", text=str(i)) for i in range(4)])
>>> stage = Sgpo(Sgpo.Config(batch_size=2, phase_steps=[5, 10], seed=0))
>>> stage.use_profile({"p:0": 8, "p:1": 5, "p:2": 4, "p:3": 1})
>>> stage.before_step(StepContext("run", step=0, seed=0, policy_version=0))
>>> sorted((e.prompt_id, e.n_rollouts) for e in stage.run(pool))  # phase 0: the G = 2 prompts
[('p:1', 2), ('p:2', 2)]

YAML:

.. code-block:: yaml

    stages:
      pick:    {use: control.sgpo, with: {batch_size: 16, phase_steps: [40, 80], max_new_tokens: 8}}
      rollout: {use: generate.sample, from: pick, with: {max_new_tokens: 8}}
"""

from __future__ import annotations

import zlib
from fractions import Fraction
from typing import Annotated, Any, ClassVar

import numpy as np
from pydantic import Field, model_validator

from gfcr.records import Allocation, AllocationEntry, ControlReason, Prompt, PromptPool, StepContext
from gfcr.registry import Seed, StageConfig
from gfcr.stages.common.epochs import start_batch
from gfcr.stages.common.run_context import RunContext
from gfcr.stages.common.seeds import step_seed
from gfcr.stages.resources import GenerationRequest, Lent, SamplingParams, prompt_tokens
from gfcr.stages.verifiers.scoring import score_text

ALIAS = "control.sgpo"
TRIVIAL, UNSOLVED, LEARNABLE = "trivial", "unsolved", "learnable"


def _exact(x: float) -> Fraction:
    """A config number as the decimal it was written as (0.7 is 7/10, not the float below it)."""
    return Fraction(repr(x))


def profile_label(successes: int, n: int, trivial_above: float) -> str:
    """``trivial`` when ``successes / n > trivial_above``, ``unsolved`` at 0, else ``learnable``."""
    if not 0 <= successes <= n or n < 1:
        raise ValueError(f"{successes} successes out of {n} profile samples")
    if Fraction(successes, n) > _exact(trivial_above):
        return TRIVIAL
    return UNSOLVED if successes == 0 else LEARNABLE


def bucket_group_size(successes: int, n: int, sizes: tuple[int, ...] = (2, 4, 8)) -> int:
    """The smallest size ``G`` in ``sizes`` with ``G * p0 >= 1`` for ``p0 = successes / n``
    (``1/p0`` rounded up onto the buckets), the largest size when none is."""
    for g in sorted(sizes):
        if g * successes >= n:
            return g
    return max(sizes)


def _unit_draw(*parts: object) -> float:
    return float(np.random.default_rng([zlib.crc32(":".join(map(str, parts)).encode())]).random())


class Sgpo:
    """sGPO: one offline profile, trivial prompts skipped, G ~ 1/p0, an easy-to-hard curriculum."""

    class Config(StageConfig):
        sizes_each_group: ClassVar[bool] = True  # a capability: it sizes each prompt's group itself
        batch_size: Annotated[int, Field(ge=1, description="prompts dispatched per call")]
        group_sizes: list[Annotated[int, Field(ge=2)]] = Field(
            default_factory=lambda: [2, 4, 8], description="the buckets of G, ascending; one curriculum phase each")
        phase_steps: list[Annotated[int, Field(ge=1)]] = Field(
            default_factory=lambda: [40, 80], description=(
                "the steps at which the second, third, ... phase starts (one fewer than group_sizes)"))
        trivial_above: Annotated[float, Field(ge=0.0, lt=1.0, description=(
            "t: prompts with p0 > t are trivial and never dispatched"))] = 0.75
        unsolved_rate: Annotated[float, Field(ge=0.0, le=1.0, description=(
            "alpha: share of the unsolved (p0 = 0) prompts kept, mixed into every phase"))] = 0.1
        profile_samples: Annotated[int, Field(ge=1, description="N: samples per prompt in the profile")] = 8
        profile_prompts: Annotated[int | None, Field(ge=1, description=(
            "profile a seeded subset of this many prompts; null: the whole pool"))] = None
        temperature: Annotated[float, Field(ge=0.0, description="profile sampling temperature")] = 1.0
        max_new_tokens: Annotated[int, Field(ge=1, description=(
            "profile response length cap (set it as the rollout stage's)"))] = 64
        seed: Seed | None = Field(None, description="permutation, sub-sampling and profile seed; default: the run's")

        @model_validator(mode="after")
        def _phases_match_buckets(self) -> "Sgpo.Config":
            if self.group_sizes != sorted(set(self.group_sizes)):
                raise ValueError(f"group_sizes must be ascending and distinct, got {self.group_sizes}")
            if len(self.phase_steps) != len(self.group_sizes) - 1:
                raise ValueError(f"phase_steps needs {len(self.group_sizes) - 1} steps (one per phase after the "
                                 f"first, for group_sizes {self.group_sizes}), got {self.phase_steps}")
            if self.phase_steps != sorted(set(self.phase_steps)):
                raise ValueError(f"phase_steps must be increasing, got {self.phase_steps}")
            return self

    def __init__(self, config: Config):
        self.config = config
        self.profile: dict[str, int] | None = None  # prompt id -> successes of profile_samples
        self.cursors: dict[str, list[int]] = {}  # phase -> [epoch, cursor]
        self.run_ctx = RunContext(config.seed)
        self._labels: dict[str, tuple[str, int]] = {}  # prompt id -> (label, G or 0)
        self._profile_seed: int | None = None
        self._spent = (0, 0)  # rollouts and tokens the profile cost (charged to the step that ran it)

    def setup(self, lent: Lent) -> None:
        self.run_ctx.setup(lent, ALIAS, policy=True, engine=True)

    def before_step(self, ctx: StepContext) -> None:
        self.run_ctx.before_step(ctx)

    # --- the profile ----------------------------------------------------------------------

    def use_profile(self, successes: dict[str, int], seed: int | None = None) -> None:
        """Take a profile (prompt id -> successes out of ``profile_samples``) and label it; the
        unsolved prompts are sub-sampled with ``seed`` (default: the stage's)."""
        self.profile = {pid: int(s) for pid, s in successes.items()}
        self._profile_seed = self.run_ctx.seed if seed is None else seed
        n, cfg = self.config.profile_samples, self.config
        self._labels = {}
        for pid, s in self.profile.items():
            label = profile_label(s, n, cfg.trivial_above)
            if label == LEARNABLE:
                self._labels[pid] = (label, bucket_group_size(s, n, tuple(cfg.group_sizes)))
            elif label == UNSOLVED and _unit_draw(self._profile_seed, "sgpo-unsolved", pid) < cfg.unsolved_rate:
                self._labels[pid] = ("unsolved_kept", 0)
            else:
                self._labels[pid] = (label, 0)

    def _run_profile(self, pool: PromptPool) -> tuple[int, int]:
        """Sample every profiled prompt ``N`` times under the current (initial) policy, score
        the samples, take the profile; returns the ``(rollouts, tokens)`` spent."""
        run = self.run_ctx
        if run.engine is None or run.policy is None:
            raise RuntimeError(f"{ALIAS} was not set up with a policy and engine (it profiles through them)")
        cfg, prompts = self.config, self._profiled_prompts(pool)
        params = SamplingParams(cfg.temperature, 1.0, cfg.max_new_tokens, (), step_seed(run.seed, "sgpo-profile"))
        requests = [GenerationRequest(f"{p.prompt_id}@profile", tuple(prompt_tokens(run.policy, p)),
                                      cfg.profile_samples, params) for p in prompts]
        results = run.engine.generate(requests)
        successes, tokens = {}, 0
        for prompt, completions in zip(prompts, results, strict=True):
            if prompt.verifier is None:
                raise ValueError(f"prompt {prompt.prompt_id} has no verifier spec: {ALIAS} cannot profile it; "
                                 "use a data source that sets `Prompt.verifier`")
            successes[prompt.prompt_id] = sum(score_text(c.text, prompt.verifier)[1].correct for c in completions)
            tokens += sum(len(c.token_ids) for c in completions)
        self.use_profile(successes)
        rollouts = len(prompts) * cfg.profile_samples
        if run.lent is not None:
            run.lent.charge_generation(rollouts, tokens)
        return rollouts, tokens

    def _profiled_prompts(self, pool: PromptPool) -> list[Prompt]:
        k = self.config.profile_prompts
        if k is None or k >= len(pool):
            return list(pool)
        picked = np.sort(np.random.default_rng([self.run_ctx.seed, 7]).permutation(len(pool))[:k])
        return [pool[int(i)] for i in picked]

    # --- the curriculum -------------------------------------------------------------------

    def phase_at(self, step: int) -> int:
        """The curriculum phase of ``step`` from ``phase_steps`` alone (before skipping empty phases)."""
        return sum(step >= s for s in self.config.phase_steps)

    def _phase_prompts(self, pool: PromptPool, phase: int) -> list[Prompt]:
        g = self.config.group_sizes[phase]
        return [p for p in pool if self._labels.get(p.prompt_id) in (("learnable", g), ("unsolved_kept", 0))]

    def run(self, pool: PromptPool) -> Allocation:
        profiled_now = self.profile is None
        if profiled_now:
            self._spent = self._run_profile(pool)
        phase = self.phase_at(self.run_ctx.step)
        prompts = self._phase_prompts(pool, phase)
        while not prompts and phase + 1 < len(self.config.group_sizes):  # an empty phase is skipped
            phase += 1
            prompts = self._phase_prompts(pool, phase)
        g = self.config.group_sizes[phase]
        picked = self._next_batch(phase, len(prompts))
        entries = tuple(self._entry(prompts[i], g, phase) for i in picked)
        skipped = self._skipped(pool) if profiled_now else ()
        return Allocation(step=self.run_ctx.step, entries=entries + skipped,
                          controller_state=self._metrics(phase, g, prompts, entries))

    def _next_batch(self, phase: int, size: int) -> list[int]:
        if size == 0:
            return []
        batch = min(self.config.batch_size, size)
        epoch, cursor = self.cursors.get(str(phase), [0, 0])
        epoch, cursor = start_batch(epoch, cursor, batch, size)
        order = np.random.default_rng([self.run_ctx.seed, phase, epoch]).permutation(size)[cursor : cursor + batch]
        self.cursors[str(phase)] = [epoch, cursor + batch]
        return [int(i) for i in order]

    def _entry(self, prompt: Prompt, g: int, phase: int) -> AllocationEntry:
        label, _ = self._labels[prompt.prompt_id]
        s, n = self.profile[prompt.prompt_id], self.config.profile_samples
        kind = "unsolved (kept)" if label == "unsolved_kept" else "learnable"
        why = ControlReason(label, "p0", s / n, {"successes": s, "samples": n, "group_size": g, "phase": phase})
        return AllocationEntry(prompt, g, reason=f"sgpo: {kind}, p0 {s}/{n}, G {g}, phase {phase}", why=why)

    def _skipped(self, pool: PromptPool) -> tuple[AllocationEntry, ...]:
        """The profiled prompts its labels drop for the whole run (trivial, unsolved not kept), as
        skipped entries of the call that profiled them: the decision is made once, there."""
        cfg, n, out = self.config, self.config.profile_samples, []
        for prompt in (p for p in pool if p.prompt_id in self._labels):
            label, s = self._labels[prompt.prompt_id][0], self.profile[prompt.prompt_id]
            if label == TRIVIAL:
                why = ControlReason(TRIVIAL, "p0", s / n,
                                    {"successes": s, "samples": n, "trivial_above": cfg.trivial_above})
            elif label == UNSOLVED:
                draw = _unit_draw(self._profile_seed, "sgpo-unsolved", prompt.prompt_id)
                why = ControlReason(UNSOLVED, "p0", 0.0,
                                    {"samples": n, "keep_draw": draw, "unsolved_rate": cfg.unsolved_rate})
            else:
                continue
            out.append(AllocationEntry(prompt, 0, reason=f"sgpo: {label}, p0 {s}/{n}, never dispatched", why=why))
        return tuple(out)

    def _metrics(self, phase: int, g: int, prompts: list[Prompt], entries: tuple[AllocationEntry, ...]) -> dict[str, Any]:
        n = self.config.profile_samples
        p0 = [self.profile[e.prompt_id] / n for e in entries]
        labels = [label for label, _ in self._labels.values()]
        state: dict[str, Any] = {
            "phase": phase, "group_size": g, "phase_prompts": len(prompts),
            "epoch": self.cursors.get(str(phase), [0, 0])[0], "chosen": len(entries),
            "predicted_success": float(np.mean(p0)) if p0 else 0.0,
            "chosen_unsolved": sum(self._labels[e.prompt_id][0] == "unsolved_kept" for e in entries),
            "trivial": labels.count(TRIVIAL), "unsolved": labels.count(UNSOLVED) + labels.count("unsolved_kept"),
            "unsolved_kept": labels.count("unsolved_kept"),
            "profile_rollouts": self._spent[0], "profile_tokens": self._spent[1],
        }
        for size in self.config.group_sizes:
            state[f"learnable_g{size}"] = sum(v == (LEARNABLE, size) for v in self._labels.values())
        return state

    def state_dict(self) -> dict[str, Any]:
        """Plain JSON-serializable data: the profile (successes per prompt; the labels follow
        from it) and each phase's epoch and cursor."""
        return {"profile": self.profile, "profile_seed": self._profile_seed, "profile_cost": list(self._spent),
                "cursors": {k: list(v) for k, v in self.cursors.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.cursors = {str(k): [int(v[0]), int(v[1])] for k, v in state["cursors"].items()}
        self.profile, self._labels = None, {}
        self._spent = (int(state["profile_cost"][0]), int(state["profile_cost"][1]))
        if state["profile"] is not None:
            self.use_profile(state["profile"], int(state["profile_seed"]))
