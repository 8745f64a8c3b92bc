"""MEDS (``filter.meds``'s memory: kNN assignment to past HDBSCAN clusters, relabelling, the
target and the shaped reward) against ``cluster_and_log`` of Linxi000/MEDS and its estimator,
over multi-step traces of given fingerprints (the last 14 layers' answer logits; null where a
response has no ``\\boxed{``)."""

from __future__ import annotations

import sys
from typing import Any

import numpy as np
import pytest

from gfcr.registry import STAGES
from gfcr.stages.filter.error_memory import ErrorMemory
from tests.fidelity.cases import case_ids, cases, check

METHOD = "meds_clusters"


def replay(inp: dict[str, Any]) -> list[dict[str, Any]]:
    cls = STAGES.get("filter.meds")
    module, cfg = sys.modules[cls.__module__], cls.Config(target=inp["target"])
    memory = ErrorMemory(cfg.memory_per_prompt, cfg.max_prompts, cfg.k, cfg.min_cluster_size)
    wanted = module.TARGETS[cfg.target]
    out = []
    for samples in inp["steps"]:
        marked = [i for i, s in enumerate(samples) if s["features"] is not None and s["correct"] in wanted]
        keys = [(samples[i]["prompt"], samples[i]["correct"]) for i in marked]
        vectors = np.array([samples[i]["features"] for i in marked], dtype=float).reshape(len(marked), -1 if marked else 0)
        sizes = [0] * len(samples)
        for i, size in zip(marked, module.cluster_sizes(memory, keys, vectors)):
            sizes[i] = size
        rewards = [module.shaped(s["reward"], s["correct"], module.meds_penalty(z, cfg.alpha, cfg.beta))
                   for s, z in zip(samples, sizes)]
        out.append({"sizes": sizes, "rewards": rewards})
    return out


@pytest.mark.parametrize("case", cases(METHOD), ids=case_ids(METHOD))
def test_meds_clusters_match_the_reference(case):
    check(METHOD, case, replay)
