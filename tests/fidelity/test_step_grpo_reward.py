"""Step-GRPO's step-aware relative reward (``filter.step_reward``) against ``compute_score`` of
davidweidawang/Step-GRPO (``examples/reward_function/step_grpo.py``), with the reference's accuracy
and format given as the verifier's verdict."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import pytest

from gfcr.records import Rollout, RolloutGroup, RolloutGroups, Segment
from gfcr.stages.filter.step_reward import StepReward, count_steps, group_baseline
from tests.fidelity.cases import case_ids, cases, check, load

METHOD = "step_grpo_reward"


def run(inp: dict[str, Any]) -> list[dict[str, float]]:
    verdicts = load(METHOD)["cases"]  # the reference's accuracy and format, by case and position
    expected = next(c["expected"] for c in verdicts if c["input"] == inp)
    config = StepReward.Config(alpha=inp["alpha"], beta=inp["beta"], **(
        {"words": inp["trigger_words"]} if "trigger_words" in inp else {}))
    rollouts, by_uid = [], defaultdict(list)
    for i, (r, verdict) in enumerate(zip(inp["rollouts"], expected)):
        ok = verdict["accuracy"] > 0.5
        rollout = Rollout(f"{r['uid']}/{i}", r["uid"], r["uid"], [1], [Segment(0, 1, 0, [0.0])], reward=float(ok),
                          correct=ok, text=r["response"],
                          reward_components={"correct": float(ok), "format": verdict["format"]})
        rollouts.append(rollout)
        by_uid[r["uid"]].append(rollout)
    groups = RolloutGroups([RolloutGroup(uid, uid, 0, len(rs), rs) for uid, rs in by_uid.items()])
    StepReward(config).run(groups)
    out = []
    for r in rollouts:
        group = by_uid[r.group_id]
        steps = [count_steps(x.text, config.words) for x in group]
        mu = group_baseline(steps, [bool(x.correct) for x in group], config.baseline)
        out.append({"overall": r.reward, "accuracy": float(r.correct), "format": r.reward_components["format"],
                    "steps": float(count_steps(r.text, config.words)), "step_mean": 0.0 if mu is None else mu})
    return out


@pytest.mark.parametrize("case", cases(METHOD), ids=case_ids(METHOD))
def test_step_reward_matches_compute_score(case):
    check(METHOD, case, run)
