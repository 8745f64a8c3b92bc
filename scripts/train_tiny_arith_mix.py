"""Pretrain ``tiny-arith-mix`` and write it to ``gfcr/assets/tiny-arith-mix/``.

Command (from the repo root; CPU, one thread, deterministic: two runs wrote byte-identical
folders, after 937 s and 825 s of training on a shared 2-core machine)::

    HF_HUB_OFFLINE=1 .venv/bin/python scripts/train_tiny_arith_mix.py
    HF_HUB_OFFLINE=1 .venv/bin/python scripts/train_tiny_arith_mix.py --eval-only

It ends by printing the base behaviour the model card reports (per category, and the
histogram of base pass@8 over the task's eval pool). ``--out DIR`` writes somewhere else.

What the model is for
---------------------
The ``arith-mix`` task (``gfcr/tasks/arith-mix.yaml``): prompts from the ``arithmetic_mix``
data source, eight categories from ``1d+1d`` to ``2d*1d carry``. A benchmark of RL
pipelines at equal compute needs prompts of *every* difficulty for the base policy: per-
prompt pass rates spread over 0..1, not bunched at 0 and 1 (``tiny-arith``'s are bimodal).

The recipe: ``tiny-arith``'s systematic slip, graded by category
---------------------------------------------------------------
Same architecture, tokenizer and optimiser as ``tiny-arith`` (the helpers are imported from
``scripts/train_tiny_arith.py``). Every training answer is the correct integer with a
probability ``P_CORRECT[category]`` and otherwise the *slip*, one mistake in the units
column per operator, applied to every problem:

* ``a + b``: the carry backwards: drops a needed carry (``47 + 15 -> 52``, ``7 + 5 -> 2``)
  or invents one (``47 + 12 -> 69``, ``4 + 3 -> 17``);
* ``a - b`` (``big - small``, sign in front): the borrow backwards: forgets a needed borrow
  (``47 - 18 -> 39``) or invents one (``47 - 12 -> 25``, ``66 - 60 -> -4``);
* ``a * b`` (``b`` one digit): drops the carry of the units product (``47 * 3 -> 121``,
  ``7 * 8 -> 6``) or, where there is none, invents a carry of one (``23 * 3 -> 79``).

``P_CORRECT`` runs from 0.9 (``1d+1d``) down to 0.15 (``2d*1d carry``), so the model's
chance of sampling the right answer is graded by category, and within a category it varies
by problem with whatever natural errors the model keeps. Greedy decoding follows the larger
of the two, so it is right on the easy categories and slips on the hard ones; GRPO can move
each category's slip-or-not preference.

The first ``CLEAN_FRACTION`` of the steps see correct answers only (the arithmetic is learnt
faster from clean labels), the rest the graded mixture. Batches draw categories with
``TRAIN_WEIGHTS`` (the multiplications, the hardest to learn, twice as often), then a
problem of the category's ``train`` split: the ``eval`` split of ``arithmetic_mix`` is never
trained on.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_tiny_arith import (  # noqa: E402  (the shared helpers)
    BATCH, LR, WARMUP, build_model, build_tokenizer, first_int, generate, well_formed,
)

from gfcr.stages.data.arithmetic_mix import (  # noqa: E402
    CATEGORIES, ArithmeticMixSource, answer, problems, units_carry,
)

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "gfcr" / "assets" / "tiny-arith-mix"
SEED = 4321
TEMPLATE = "What is {expr}? Answer:"
STEPS = 2400
CLEAN_FRACTION = 0.5
P_CORRECT = {  # chance a training answer is right (else the slip), by category
    "1d+1d": 0.9, "1d*1d": 0.8, "2d+2d no carry": 0.7, "2d-2d no borrow": 0.6,
    "2d*1d no carry": 0.45, "2d+2d carry": 0.35, "2d-2d borrow": 0.25, "2d*1d carry": 0.15,
}
TRAIN_WEIGHTS = {name: 2.0 if CATEGORIES[name].op == "*" else 1.0 for name in CATEGORIES}
EVAL_POOL = dict(n=200, seed=1, split="eval")  # the task's eval pool (gfcr/tasks/arith-mix.yaml)


def slip(a: int, op: str, b: int) -> int:
    """The slip answer to ``a op b``: the units column's carry (or borrow) backwards."""
    if op == "-":
        big, small, sign = max(a, b), min(a, b), (1 if a >= b else -1)
        return sign * (big - small + (10 if units_carry(a, op, b) else -10))
    carry = (a % 10 + b % 10) // 10 if op == "+" else (a % 10) * b // 10
    return answer(a, op, b) + (-10 * carry if carry else 10)


def prompt_text(a: int, op: str, b: int) -> str:
    return TEMPLATE.format(expr=f"{a} {op} {b}")


# --------------------------------------------------------------------------------------------
# Training


def to_tensors(rows: list[list[int]], masks: list[list[int]], pad: int):
    """Right-padded ids, attention mask and labels (-100 outside the completion)."""
    width = max(map(len, rows))
    ids = torch.full((len(rows), width), pad)
    labels = torch.full((len(rows), width), -100)
    attn = torch.zeros((len(rows), width), dtype=torch.long)
    for r, (row, mask) in enumerate(zip(rows, masks)):
        ids[r, : len(row)] = torch.tensor(row)
        attn[r, : len(row)] = 1
        labels[r, : len(row)] = torch.tensor([t if m else -100 for t, m in zip(row, mask)])
    return ids, attn, labels


def make_batch(rng: np.random.Generator, tok, size: int, clean: bool):
    names = list(CATEGORIES)
    weights = np.array([TRAIN_WEIGHTS[n] for n in names])
    rows, masks = [], []
    for c in rng.choice(len(names), size, p=weights / weights.sum()):
        pool = problems(names[c], "train")
        a, op, b = pool[int(rng.integers(len(pool)))]
        value = answer(a, op, b)
        if not clean and rng.random() >= P_CORRECT[names[c]]:
            value = slip(a, op, b)
        prompt = tok(prompt_text(a, op, b)).input_ids
        completion = tok(f" {value}").input_ids + [tok.eos_token_id]
        rows.append(prompt + completion)
        masks.append([0] * len(prompt) + [1] * len(completion))
    return to_tensors(rows, masks, tok.pad_token_id)


def probe(model, tok) -> str:
    """Greedy accuracy on 16 eval problems per category (progress only; uses no randomness)."""
    pool = ArithmeticMixSource(ArithmeticMixSource.Config(n=16 * len(CATEGORIES), seed=2, split="eval")).load()
    model.eval()
    out = generate(model, tok, [p.text for p in pool], 1, sample=False, seed=0)
    model.train()
    right = {}
    for p, o in zip(pool, out):
        right.setdefault(p.metadata["category"], []).append(first_int(o) == p.verifier.ground_truth)
    return " ".join(f"{k.replace(' ', '')}={np.mean(v):.2f}" for k, v in right.items())


def train(model, tok, steps: int) -> None:
    rng = np.random.default_rng(SEED)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.01},
                             {"params": no_decay, "weight_decay": 0.0}], lr=LR, betas=(0.9, 0.98))
    schedule = lambda s: min(1.0, (s + 1) / WARMUP) * 0.5 * (1 + math.cos(math.pi * s / steps))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
    model.train()
    start, running = time.time(), None
    for step in range(steps):
        ids, attn, labels = make_batch(rng, tok, BATCH, clean=step < CLEAN_FRACTION * steps)
        loss = model(input_ids=ids, attention_mask=attn, labels=labels).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        running = loss.item() if running is None else 0.98 * running + 0.02 * loss.item()
        if step % 100 == 0 or step == steps - 1:
            print(f"step {step:5d}  loss {running:.4f}  lr {sched.get_last_lr()[0]:.2e}  "
                  f"{time.time() - start:6.1f}s", flush=True)
        if step % 300 == 299 or step == steps - 1:
            print(f"  greedy {probe(model, tok)}", flush=True)
    model.eval()


# --------------------------------------------------------------------------------------------
# Evaluation: the numbers in the model card


def evaluate(model, tok) -> dict:
    pool = ArithmeticMixSource(ArithmeticMixSource.Config(**EVAL_POOL)).load()
    prompts = [p.text for p in pool]
    truths = [p.verifier.ground_truth for p in pool]
    cats = np.array([p.metadata["category"] for p in pool])
    slips = [str(slip(*map_expr(p.metadata["expr"]))) for p in pool]
    greedy = generate(model, tok, prompts, 1, sample=False, seed=0)
    samples = generate(model, tok, prompts, 8, sample=True, seed=0)
    g_right = np.array([first_int(g) == t for g, t in zip(greedy, truths)])
    right = np.array([first_int(s) == t for s, t in zip(samples, np.repeat(truths, 8))]).reshape(-1, 8)
    is_slip = np.array([first_int(s) == sl for s, sl in zip(samples, np.repeat(slips, 8))]).reshape(-1, 8)
    passes = right.sum(1)
    per_category = {name: {
        "greedy_accuracy": round(float(g_right[cats == name].mean()), 3),
        "sample_accuracy_T1": round(float(right[cats == name].mean()), 3),
        "sample_is_slip_T1": round(float(is_slip[cats == name].mean()), 3),
        "pass8_histogram": np.bincount(passes[cats == name], minlength=9).tolist(),
    } for name in CATEGORIES}
    return {
        "eval_pool": EVAL_POOL | {"prompts": len(pool)},
        "greedy_accuracy": float(g_right.mean()),
        "sample_accuracy_T1": float(right.mean()),
        "pass8_histogram": np.bincount(passes, minlength=9).tolist(),
        "fraction_at_0_or_8": float(np.mean((passes == 0) | (passes == 8))),
        "correct_or_slip_fraction": float(np.mean(right | is_slip)),
        "well_formed_fraction": float(np.mean([well_formed(s) for s in samples])),
        "per_category": per_category,
        "examples": list(zip(prompts[:8], greedy[:8], truths[:8])),
    }


def map_expr(expr: str) -> tuple[int, str, int]:
    a, op, b = expr.split()
    return int(a), op, int(b)


# --------------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--eval-only", action="store_true", help="evaluate the saved folder")
    args = parser.parse_args()

    torch.set_num_threads(1)  # one thread: bit-identical weights on any machine
    torch.use_deterministic_algorithms(True)
    random.seed(SEED)
    np.random.seed(SEED)
    torch.manual_seed(SEED)

    if args.eval_only:
        tok = AutoTokenizer.from_pretrained(args.out)
        model = AutoModelForCausalLM.from_pretrained(args.out).eval()
    else:
        tok = build_tokenizer()
        model = build_model(tok)
        print(f"{sum(p.numel() for p in model.parameters()):,} parameters", flush=True)
        start = time.time()
        train(model, tok, args.steps)
        print(f"trained in {time.time() - start:.0f}s", flush=True)
        args.out.mkdir(parents=True, exist_ok=True)
        model.save_pretrained(args.out, safe_serialization=True)
        build_tokenizer().save_pretrained(args.out)  # fresh: the progress probes set padding on `tok`

    print(json.dumps(evaluate(model, tok), indent=2))


if __name__ == "__main__":
    main()
