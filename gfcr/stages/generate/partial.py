"""generate.partial: partial rollouts carried across steps (APRIL's buffer, CoPRIS's re-queue).

Sampling is ``generate.sample``'s (same Config, requests, seeding and in-flight controllers);
what this stage adds is a **partial buffer**. When an in-flight controller ends generation
early (``control.stop_at_target``: stop once ``N`` groups are complete), every group that still
has an unfinished row goes, whole, into the buffer: its finished rows as they are, its aborted
rows with their token ids, segments (behaviour log-probs and policy versions) and text. The
group is output dropped ("to the partial buffer ...") so a filter or the update never sees a
half-made group, and its rows still count in the step's ``tokens_generated``.

Next call (the next step, or the next round of a loop block) the buffer is **drained first**:

- at most ``groups_in_flight`` groups are generated per call (APRIL's ``N'``; default: the
  allocation's active entries). Buffered groups take the first places, oldest first; fresh
  allocation entries fill the rest, in allocation order; the entries left over are deferred
  (not generated this call, reported as ``deferred``);
- a buffered group is resumed under a new group id ``<first group id>~p<step>`` (``.r<round>``
  in loop rounds > 0) with one request per unfinished row, continuing from its token ids (a
  ``ResponsePrefix``, never re-tokenized text) with the budget it has left (``max_new_tokens``
  caps the whole response); its finished rows are carried as they are. Every rollout of it
  records ``resumed_from`` (its id at the step it came from) and ``resumed_tokens`` (the tokens
  sampled before this step), so ``tokens_generated`` counts only the new ones;
- the new tokens get a segment at the current policy version after the prefix's own segments,
  so the update sees each token's behaviour log-prob and staleness (spliced, CoPRIS-style).

The buffer is the stage's checkpointed state, so a resumed run continues the same partials.

The two methods, both as ``generate.partial`` plus ``control.stop_at_target`` (see
``pipelines/april_arith.yaml`` and ``pipelines/copris_arith.yaml``):

- **APRIL** (Zhou et al., arXiv 2509.18521; ``RLsys-Foundation/APRIL``, slime's
  ``sglang_example.py``): the control stage allocates ``N'`` groups (README: 64 for 32), every
  row is in flight at once, ``stop_at_target`` aborts all at ``N`` complete groups, the partials
  resume next step from the buffer (``pop_first``), and the update takes no IS correction
  (``update.grpo`` ``correction: {use: recompute_old}``: the ratio against recomputed ``pi_old``).
- **CoPRIS** (Qu et al., arXiv 2511.05589; ``777pomingzi/CoPRIS``): a fixed concurrency ``C``
  of rows (``max_in_flight``), a freed slot refilled at once from the queue, stop at ``B``
  groups, the cancelled rows re-queued at the front (the buffer drained first), and the PPO
  ratio against the spliced behaviour log-probs (``update.grpo``'s default ratio, with
  ``dual_clip: 10`` as its script's ``clip_ratio_c``).

Deviations:

- a group counts as complete when all its rows have ended (before verification: gfcr scores
  after generation). APRIL counts a group once its rewards are in, and CoPRIS counts *kept*
  groups, dropping zero-variance ones under ``filter_groups``; here a zero-variance group still
  counts toward the target and a later ``filter.nonzero_variance`` drops it, so fewer than ``N``
  informative groups may reach the update (compose with ``filter.dynamic_sampling`` in a loop
  block to top up, as ``pipelines/april_dapo_arith.yaml`` does);
- APRIL and CoPRIS pull fresh prompts from the dataset only as places free up; in gfcr the
  Control stage picks a step's prompts before generation, so the picked prompts beyond
  ``groups_in_flight`` are deferred (skipped this step; with ``control.uniform`` they come back
  in a later epoch). Their number is reported as ``deferred``;
- CoPRIS keeps unstarted requests queued too; here a row that never started is kept with no
  tokens in its group's buffer entry and starts afresh (its own seed) next call;
- a resumed row draws from its own seeded stream (its new request id), not the stream the
  aborted row was using; seeds still depend only on (seed, step, round, group, row);
- the buffer has no age limit (neither reference has one); an ``update.grpo`` correction's
  ``max_staleness`` masks tokens that are too old.

Metrics per step: ``buffered`` (groups in the buffer after the call), ``resumed_groups``,
``to_buffer`` (groups the call put there), ``deferred`` and ``resumed_tokens`` (tokens carried in).

Fidelity: checked against THUDM/slime@624b824: 7/8 cases, 1 documented deviation (APRIL);
checked against 777pomingzi/CoPRIS@43ee8c7: 5/5 cases (CoPRIS).

- APRIL (``tests/fidelity/april.json``: ``RolloutDataSourceWithBuffer.get_samples`` / ``add_samples``
  with ``pop_first``, the buffer order ``components/partial_rollout_fn.py`` also keeps; the rule
  is ``serve`` here). Buffered groups are served first, oldest first, then fresh prompts, and a
  resumed group left unfinished again goes to the back. The deviation: the partials of a call
  join the buffer in the order the call served them; slime appends them in the order its
  ``abort()`` collects their tasks (asyncio's completion order). Read, not run
  (``sglang_rollout.py``, ``generate_rollout_async``): slime asks for ``--over-sampling-batch-size``
  groups (default: the rollout batch; it asserts the over-sampling batch is at least the rollout
  batch) and asks again while the groups in flight or kept fall below the target after dynamic-
  filter drops; here ``groups_in_flight`` is one call's places (with fewer places than
  ``stop_at_target``'s groups the stop never fires and nothing is buffered; nothing checks this),
  and the top-up is ``filter.dynamic_sampling`` in a loop block. Groups that finish past the
  target in the same wait are discarded by slime ("not stored back"). slime's
  ``--mask-offpolicy-in-partial-rollout`` (off by default) zeroes the loss mask of a resumed
  sample's earlier tokens; ``max_staleness: 0`` on the update's correction does the same here.
- CoPRIS (``tests/fidelity/copris.json``).
  Its importance-sampling correction lives in ``verl/trainer/ppo/ray_trainer.py``, ``fit``
  (L1140-1203): after every generation round the actor recomputes ``old_log_probs`` of every
  returned row, finished or not (``agent_loop.py`` returns the cancelled ones too), and the
  trainer keeps, per (prompt, row), the values it had and appends only the new tail
  (``torch.cat((stored, new[:, len(stored):]))``), so each token's ``pi_old`` is the policy that
  sampled it; the PPO ratio (clip 0.2/0.28, dual clip ``clip_ratio_c`` 10) is taken against that.
  Here a resumed row's new tokens are a segment after its prefix's (``splice``) and the update's
  ratio is against those behaviour log-probs: the same values, with one difference in where they
  come from: CoPRIS recomputes them with the trainer's forward pass, gfcr keeps the sampler's
  (identical with the transformers engine up to batching; with vLLM they differ by the
  sampler/trainer mismatch, which ``update.grpo``'s ``recompute_old`` correction avoids at the
  cost of recomputing with the current weights, not the sampling ones).

Example (the ``tiny-arith`` policy; the stop below aborts after 3 decode steps, so every
row of the 8-token budget is unfinished, goes to the buffer, and resumes at the next step,
taking the one place of that call):

>>> from gfcr.engines import TransformersEngine, load_policy
>>> from gfcr.records import Allocation, AllocationEntry, Prompt, StepContext
>>> from gfcr.spec import PolicySpec
>>> from gfcr.stages.engine import Steer
>>> from gfcr.stages.resources import Lent
>>> class StopAt3:
...     every = 3
...     def steer(self, view): return Steer(stop=True)
>>> policy = load_policy(PolicySpec(model="tiny-arith"))
>>> stage = Partial(Partial.Config(max_new_tokens=8, temperature=1.0))
>>> stage.setup(Lent(policy, TransformersEngine(policy)))
>>> stage.attach_in_flight([StopAt3()])
>>> prompt = Prompt("a:0", text="What is 12 + 30? Answer:")
>>> first = stage.run(Allocation(0, (AllocationEntry(prompt, 2),)), StepContext("run", step=0, seed=0, policy_version=0))
>>> first.groups[0].verdict.included, len(stage.buffer)
(False, 1)
>>> stage.attach_in_flight([])
>>> fresh = Prompt("a:1", text="What is 5 + 7? Answer:")  # one place: the buffered group takes it
>>> second = stage.run(Allocation(1, (AllocationEntry(fresh, 2),)), StepContext("run", step=1, seed=0, policy_version=1))
>>> group = second.groups[0]
>>> group.group_id, [r.resumed_from for r in group.rollouts], len(stage.buffer), stage.step_metrics()["deferred"]
('a:0@s0~p1', ['a:0@s0/0', 'a:0@s0/1'], 0, 1)
>>> [r.resumed_tokens for r in group.rollouts], [s.start for s in group.rollouts[0].segments]  # spliced
([3, 3], [0, 3])

YAML:

.. code-block:: yaml

    stop:    {use: control.stop_at_target, with: {groups: 8}}
    rollout: {use: generate.partial, from: budget, in_flight: [stop], with: {max_new_tokens: 32}}
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from collections.abc import Sequence
from typing import Annotated, Any, TypeVar

from pydantic import Field

from gfcr.records import (
    Allocation, AllocationEntry, Origin, Rollout, RolloutGroup, RolloutGroups, RolloutStatus, StepContext, group_id,
    rollout_id,
)
from gfcr.stages.engine import ResponsePrefix, SamplingParams
from gfcr.stages.generate.rollout_state import copy_segment, rollout_from_state, rollout_state, snapshot
from gfcr.stages.generate.sample import Sample, to_rollout
from gfcr.stages.resources import GenerationRequest

T, U = TypeVar("T"), TypeVar("U")
TO_BUFFER = "to the partial buffer"  # the drop reason of a group carried to the next call


@dataclass
class BufferedGroup:
    """A group with unfinished rows, waiting in the buffer: everything needed to resume it."""

    root: str  # the group id it was first generated under
    prompt_id: str
    prompt_token_ids: tuple[int, ...]
    target_size: int
    sample_weight: float
    rollouts: list[Rollout]  # finished ones as they are, aborted ones with their partial response


class Partial(Sample):
    """``generate.sample`` with a partial buffer: unfinished groups resume at the next call."""

    _alias = "generate.partial"
    hand_over = None  # its own run hands no group over: not streamed (`lifecycle.stream_groups` refuses it)

    class Config(Sample.Config):
        groups_in_flight: Annotated[int | None, Field(ge=1, description=(
            "groups generated per call, buffered ones first (APRIL's N'); default: the allocation's"))] = None

    def __init__(self, config: Config):
        super().__init__(config)
        self.buffer: list[BufferedGroup] = []
        self._metrics: dict[str, float] = {}

    def run(self, allocation: Allocation, ctx: StepContext | None = None) -> RolloutGroups:
        ctx, round_, params = self.sampling(allocation, ctx)
        cfg = self.config
        entries = allocation.active()
        resumed, self.buffer, fresh = serve(self.buffer, entries, cfg.groups_in_flight or len(entries))
        suffix = f"~p{allocation.step}" + (f".r{round_}" if round_ else "")
        plan = [_Resume(b, b.root + suffix) for b in resumed] + [_Fresh(e, allocation.step, round_) for e in fresh]
        requests = [req for item in plan for req in item.requests(self, params)]
        results = iter(self.engine.generate(requests, self.controller, cfg.max_in_flight))
        version, groups, to_buffer = self.engine.policy_version, [], 0
        for item in plan:
            group = item.group([next(results) for _ in item.pending], version, allocation.step, self)
            unfinished = sum(r.status == RolloutStatus.ABORTED_PARTIAL for r in group.rollouts)
            if unfinished:
                self.buffer.append(BufferedGroup(item.root, group.prompt_id, item.prompt_ids, group.target_size,
                                                 group.sample_weight, [snapshot(r) for r in group.rollouts]))
                group.drop(f"{TO_BUFFER}: {unfinished} of {len(group.rollouts)} rollouts unfinished when "
                           "generation stopped; they resume at the next call")
                to_buffer += 1
            groups.append(group)
        self._metrics = {"buffered": len(self.buffer), "resumed_groups": len(resumed), "to_buffer": to_buffer,
                         "deferred": len(entries) - len(fresh),
                         "resumed_tokens": sum(r.resumed_tokens for g in groups[:len(resumed)] for r in g.rollouts)}
        return RolloutGroups(groups)

    def step_metrics(self) -> dict[str, float]:
        return dict(self._metrics)

    def state_dict(self) -> dict[str, Any]:
        return {"buffer": [{"root": b.root, "prompt_id": b.prompt_id, "prompt_token_ids": list(b.prompt_token_ids),
                            "target_size": b.target_size, "sample_weight": b.sample_weight,
                            "rollouts": [rollout_state(r) for r in b.rollouts]} for b in self.buffer]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.buffer = [BufferedGroup(b["root"], b["prompt_id"], tuple(b["prompt_token_ids"]), b["target_size"],
                                     b["sample_weight"], [rollout_from_state(r) for r in b["rollouts"]])
                       for b in state["buffer"]]


def serve(buffer: Sequence[T], fresh: Sequence[U], places: int) -> tuple[list[T], list[T], list[U]]:
    """Who generates this call: the buffered groups first, oldest first, then fresh entries in order,
    ``places`` in all (slime's ``pop_first`` then the dataset). Returns the buffered groups served,
    the buffer left, and the fresh entries served; the buffer's new partials are appended after it."""
    served = list(buffer[:places])
    return served, list(buffer[places:]), list(fresh[:max(0, places - len(served))])


class _Fresh:
    """A new group of an allocation entry: one request of ``n`` rows, as ``generate.sample`` makes it."""

    def __init__(self, entry: AllocationEntry, step: int, round_: int):
        self.entry, self.step, self.round = entry, step, round_
        self.root = group_id(entry.prompt_id, step, round_)
        self.pending = [0]  # one request

    def requests(self, stage: Sample, params: SamplingParams) -> list[GenerationRequest]:
        self.request = stage.request(self.entry, self.step, self.round, params)
        self.prompt_ids = self.request.prompt_token_ids
        return [self.request]

    def group(self, results: list[list[Any]], version: int, step: int, stage: Sample) -> RolloutGroup:
        return stage.group(self.entry, self.request, results[0], version, step)


class _Resume:
    """A buffered group resumed: a request per unfinished row, its finished rows carried."""

    def __init__(self, buffered: BufferedGroup, gid: str):
        self.buffered, self.gid, self.root = buffered, gid, buffered.root
        self.prompt_ids = buffered.prompt_token_ids
        self.pending = [i for i, r in enumerate(buffered.rollouts) if r.status == RolloutStatus.ABORTED_PARTIAL]

    def requests(self, stage: Sample, params: SamplingParams) -> list[GenerationRequest]:
        self.sent = {}
        for i in self.pending:
            r = self.buffered.rollouts[i]
            segments = tuple(s for s in r.segments if len(s))
            prefix = ResponsePrefix(tuple(r.response_token_ids), segments)
            self.sent[i] = GenerationRequest(rollout_id(self.gid, i), self.prompt_ids, 1, params, prefix, self.gid)
        return list(self.sent.values())

    def group(self, results: list[list[Any]], version: int, step: int, stage: Sample) -> RolloutGroup:
        b, done = self.buffered, dict(zip(self.pending, results))
        rollouts = []
        for i, old in enumerate(b.rollouts):
            if i in done:
                new = to_rollout(self.sent[i], 0, b.prompt_id, done[i][0], version, step, stage.why(self.sent[i], 0))
                new = replace(new, rollout_id=rollout_id(self.gid, i), group_id=self.gid, origin=Origin.RESUMED)
            else:
                new = _carried(old, rollout_id(self.gid, i), self.gid)
            new.resumed_from, new.resumed_tokens, new.created_step = old.rollout_id, len(old), old.created_step
            rollouts.append(new)
        return RolloutGroup(self.gid, b.prompt_id, step, b.target_size, rollouts, sample_weight=b.sample_weight)


def _carried(r: Rollout, rid: str, gid: str) -> Rollout:
    """A finished rollout carried into its resumed group: its response and outcome of generation,
    no scores (the verifier scores the whole group again)."""
    return Rollout(rid, gid, r.prompt_id, list(r.response_token_ids), [copy_segment(s) for s in r.segments],
                   status=r.status, origin=r.origin, finish_reason=r.finish_reason, created_step=r.created_step,
                   text=r.text, replica=r.replica, ray_node=r.ray_node, token_entropy=r.token_entropy)
