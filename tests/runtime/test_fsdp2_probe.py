"""torch's FSDP2 (``fully_shard``) on the CPU over gloo, 2 ranks (benchmarks/fsdp2_cpu.py, issue 43 Must
show 3 as a probe; not gfcr's trainer ranks): one AdamW step on tiny-arith-h64 gives the gradients and
parameters of one process, and each rank holds half the parameters, gradients and AdamW state of a
replicated rank. Slow: it spawns 2 x 2 rank processes, each importing torch and transformers."""

from __future__ import annotations

import pytest

from benchmarks.fsdp2_cpu import LR, compare


@pytest.mark.slow
def test_fsdp2_on_gloo_equals_one_process_and_halves_what_a_rank_holds():
    result = compare("tiny-arith-h64", ranks=2, rows=4, tokens=16)
    for mode in ("replicated", "fsdp2"):
        assert result[mode]["max_grad_diff"] < 1e-5 * max(1.0, result[mode]["max_grad_abs"]), result[mode]
        # AdamW's first step moves each weight by about lr (1e-4): a gradient near 0 may round either way
        assert result[mode]["max_param_diff"] < 0.2 * LR, result[mode]
    replicated = result["replicated"]["ranks"][0]["held_bytes"]
    for rank in result["fsdp2"]["ranks"]:
        for kind in ("params", "grads", "adamw"):
            assert rank["held_bytes"][kind] <= replicated[kind] / 2 + 1024, (kind, rank, replicated)
