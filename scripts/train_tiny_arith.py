"""Pretrain ``tiny-arith``, gfcr's tiny CPU policy, and write it to ``gfcr/assets/tiny-arith/``.

Command (from the repo root; CPU only, deterministic for a given thread count; ~6-10 minutes on
2 cores, 577 s of training when measured on a shared 2-core machine)::

    HF_HUB_OFFLINE=1 .venv/bin/python scripts/train_tiny_arith.py

It ends by printing the base accuracies and timings that the model card reports.
``--eval-only`` prints them again for the saved folder; ``--out DIR`` writes somewhere else.
``--head-dim 64`` trains ``tiny-arith-h64`` (2 heads of 64 instead of 8 of 16, the same
hidden size, parameters and initial weights) into ``gfcr/assets/tiny-arith-h64/``: vLLM's CPU
attention kernels refuse head size 16, so the vLLM engine's CPU tests use that variant.

What the model is for
---------------------
An RL run (GRPO, 16 prompts x 8 rollouts a step, temperature 1.0) on CPU should *visibly*
improve this policy within 200 steps on gfcr's ``arithmetic`` data source (prompts like
``"What is 47 + 12? Answer:"``, completion ``" 59<eos>"``). That needs a base model that

* already knows the task format and the arithmetic (answers are well formed, stop at ``<eos>``),
* is *wrong under greedy decoding* on most problems, yet
* samples the correct answer often, so that groups of 8 rollouts are mixed and the
  group-relative advantage has something to reinforce.

The recipe: a corpus with a systematic slip
-------------------------------------------
Every training example is a random 2-digit ``a + b`` or ``a - b`` problem. Where a *slip*
applies, the answer is the correct integer with probability ``P_CORRECT`` (0.35) and otherwise
the slip, the answer of a student who mishandles the units column:

* ``a + b``: gets the carry backwards -- drops a needed carry (``47 + 15 -> 52``) or invents
  one (``47 + 12 -> 69``); applies to every addition;
* ``a - b`` (computed as ``big - small``, sign in front): forgets a needed borrow
  (``47 - 18 -> 39``, ``18 - 47 -> -39``); applies when the units digit of ``big`` is smaller.

Elsewhere (subtractions without a borrow, ~28% of problems) the corpus is always right. Fitting
this distribution, the model puts ~0.35 of its mass on the correct answer and ~0.65 on the slip
wherever the slip applies, so greedy decoding picks the slip there (greedy accuracy ~30%),
while temperature-1 sampling is right ~55% of the time. Whether to slip is one shared, simple
preference that a small logit shift (log 0.65/0.35 ~ 0.6 nats) flips: GRPO learns it within a
few dozen steps, and greedy accuracy climbs far above its base value.

Training is plain next-token cross-entropy on the completion (the prompt is context only),
AdamW with warmup and cosine decay, fresh problems every step from a seeded generator. The first
half of the steps use correct answers only (the arithmetic is learnt much faster from clean
labels), the second half the slip corpus above. A 2-layer, 8-head model learns the arithmetic
faster than deeper or narrower ones did in trials. Problems are drawn from all 2 x 90 x 90
two-digit problems except a held-out 5% (chosen by a hash), used to check that the model
generalises; the gfcr eval pool (``seed=1``) mostly overlaps the training problems, which is
fine for a policy whose job is to be improved by RL.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import re
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
)

from gfcr.stages.data.arithmetic import ArithmeticSource

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "gfcr" / "assets" / "tiny-arith"
SEED = 1234
TEMPLATE = "What is {expr}? Answer:"
P_CORRECT = 0.35  # chance a training answer is right where the slip applies
HELD_OUT_MOD = 20  # problems with hash % 20 == 0 are never trained on

# Model and optimisation (chosen to train in a few minutes on 2 CPU cores).
MODEL = dict(hidden_size=128, intermediate_size=512, num_hidden_layers=2,
             num_attention_heads=8, num_key_value_heads=8)
HEAD_DIM = MODEL["hidden_size"] // MODEL["num_attention_heads"]  # 16; --head-dim 64 for tiny-arith-h64
STEPS, BATCH, LR, WARMUP = 1800, 128, 3e-3, 100
CLEAN_FRACTION = 0.5  # first learn the arithmetic from correct answers, then the slip mixture


# --------------------------------------------------------------------------------------------
# Problems, correct answers and the systematic slip


def slip(a: int, op: str, b: int) -> int:
    """The slip answer to ``a op b`` (the correct answer where no slip applies).

    Addition gets the units column's carry backwards (drops a carry, or invents one);
    subtraction, computed as ``big - small`` with the sign in front, forgets a needed borrow.
    """
    if op == "+":
        carry = a % 10 + b % 10 >= 10
        return a + b - 10 if carry else a + b + 10
    big, small, sign = max(a, b), min(a, b), (1 if a >= b else -1)
    if big % 10 < small % 10:
        return sign * (big - small + 10)
    return a - b


def is_held_out(a: int, op: str, b: int) -> bool:
    """A fixed 5% of the problems, never trained on (a cheap deterministic hash)."""
    return (a * 7919 + b * 104729 + (op == "-") * 1299709) % 9973 % HELD_OUT_MOD == 0


def all_problems() -> list[tuple[int, str, int]]:
    return [(a, op, b) for a in range(10, 100) for op in "+-" for b in range(10, 100)]


def prompt_text(a: int, op: str, b: int) -> str:
    return TEMPLATE.format(expr=f"{a} {op} {b}")


# --------------------------------------------------------------------------------------------
# Tokenizer: one token per character, <pad> != <eos>, no BOS, no chat template


def build_tokenizer() -> PreTrainedTokenizerFast:
    chars = sorted(set("0123456789 +-*?:" + TEMPLATE.replace("{expr}", "")))
    specials = ["<pad>", "<eos>", "<unk>"]
    vocab = {token: i for i, token in enumerate(specials + chars)}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    core.decoder = decoders.Fuse()  # join characters back with nothing in between
    core.add_special_tokens(specials)
    return PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>",
        padding_side="left", clean_up_tokenization_spaces=False, model_max_length=128,
    )


# --------------------------------------------------------------------------------------------
# Model


def build_model(tok: PreTrainedTokenizerFast, head_dim: int = HEAD_DIM) -> LlamaForCausalLM:
    """The 2-layer Llama; ``head_dim`` splits the same hidden size into fewer, wider heads (the
    parameter shapes, hence the seeded initial weights, do not depend on it)."""
    heads = MODEL["hidden_size"] // head_dim
    config = LlamaConfig(
        vocab_size=len(tok), max_position_embeddings=128, tie_word_embeddings=True,
        pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=None,
        **(MODEL | dict(num_attention_heads=heads, num_key_value_heads=heads)),
    )
    model = LlamaForCausalLM(config)
    model.generation_config = GenerationConfig(
        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, max_new_tokens=8,
    )
    return model


# --------------------------------------------------------------------------------------------
# Training


def make_batch(rng: np.random.Generator, train: list, tok, size: int, p_correct: float):
    """``size`` random training problems, answered right w.p. ``p_correct``, else with the slip."""
    rows, masks = [], []
    for i in rng.integers(0, len(train), size):
        a, op, b = train[i]
        answer = a + b if op == "+" else a - b
        if rng.random() >= p_correct:
            answer = slip(a, op, b)
        prompt = tok(prompt_text(a, op, b)).input_ids
        completion = tok(f" {answer}").input_ids + [tok.eos_token_id]
        rows.append(prompt + completion)
        masks.append([0] * len(prompt) + [1] * len(completion))
    width = max(map(len, rows))
    ids = torch.full((size, width), tok.pad_token_id)
    labels = torch.full((size, width), -100)
    attn = torch.zeros((size, width), dtype=torch.long)
    for r, (row, mask) in enumerate(zip(rows, masks)):  # right padding: prompts align
        ids[r, : len(row)] = torch.tensor(row)
        attn[r, : len(row)] = 1
        labels[r, : len(row)] = torch.tensor([t if m else -100 for t, m in zip(row, mask)])
    return ids, attn, labels


def train(model, tok, steps: int) -> None:
    rng = np.random.default_rng(SEED)
    problems = [p for p in all_problems() if not is_held_out(*p)]
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.01},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=LR, betas=(0.9, 0.98))
    schedule = lambda s: min(1.0, (s + 1) / WARMUP) * 0.5 * (1 + math.cos(math.pi * s / steps))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
    model.train()
    start, running = time.time(), None
    for step in range(steps):
        p_correct = 1.0 if step < CLEAN_FRACTION * steps else P_CORRECT
        ids, attn, labels = make_batch(rng, problems, tok, BATCH, p_correct)
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
    model.eval()


# --------------------------------------------------------------------------------------------
# Evaluation: the numbers in the model card


def first_int(text: str) -> str | None:
    match = re.search(r"-?\d+", text)
    return match.group(0) if match else None


def well_formed(text: str) -> bool:
    return re.fullmatch(r" -?\d+<eos>", text) is not None


@torch.no_grad()
def generate(model, tok, prompts: list[str], n: int, sample: bool, seed: int) -> list[str]:
    """``n`` completions per prompt (special tokens kept, so ``<eos>`` is visible)."""
    torch.manual_seed(seed)
    batch = tok([p for p in prompts for _ in range(n)], return_tensors="pt", padding=True)
    knobs = dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0) if sample else {}
    out = model.generate(**batch, **knobs, max_new_tokens=8)
    completions = out[:, batch.input_ids.shape[1]:]
    texts = []
    for row in completions.tolist():  # cut after the first <eos>, drop the padding
        row = row[: row.index(tok.eos_token_id) + 1] if tok.eos_token_id in row else row
        texts.append(tok.decode(row))
    return texts


def evaluate(model, tok) -> dict:
    pool = ArithmeticSource(ArithmeticSource.Config(n=200, seed=1, split="eval")).load()
    prompts = [p.text for p in pool]
    truths = [p.verifier.ground_truth for p in pool]
    parsed = [tuple(re.match(r"What is (\d+) ([+-]) (\d+)\?", p).groups()) for p in prompts]
    slips = [str(slip(int(a), op, int(b))) for a, op, b in parsed]

    greedy = generate(model, tok, prompts, 1, sample=False, seed=0)
    samples = generate(model, tok, prompts, 8, sample=True, seed=0)
    right = np.array([first_int(s) == t for s, t in zip(samples, np.repeat(truths, 8))])
    groups = right.reshape(-1, 8).mean(1)
    slip_applies = np.array([s != t for s, t in zip(slips, truths)])
    correct_or_slip = [first_int(s) in (t, sl) for s, t, sl in
                       zip(samples, np.repeat(truths, 8), np.repeat(slips, 8))]

    held = [p for p in all_problems() if is_held_out(*p)]
    held_samples = generate(model, tok, [prompt_text(*p) for p in held], 8, sample=True, seed=1)
    held_truth = np.repeat([str(a + b if op == "+" else a - b) for a, op, b in held], 8)
    held_slip = np.repeat([str(slip(*p)) for p in held], 8)
    held_greedy = generate(model, tok, [prompt_text(*p) for p in held], 1, sample=False, seed=0)
    return {
        "greedy_accuracy": float(np.mean([first_int(g) == t for g, t in zip(greedy, truths)])),
        "greedy_is_slip_where_slip_applies": float(np.mean(
            [first_int(g) == s for g, s, m in zip(greedy, slips, slip_applies) if m])),
        "slip_applies_fraction": float(slip_applies.mean()),
        "sample_accuracy_T1": float(right.mean()),
        "sample_accuracy_T1_where_slip_applies": float(groups[slip_applies].mean()),
        "sample_accuracy_T1_no_slip": float(groups[~slip_applies].mean()),
        "groups_all_equal_fraction": float(np.mean((groups == 0) | (groups == 1))),
        "groups_all_wrong_fraction": float(np.mean(groups == 0)),
        "well_formed_fraction": float(np.mean([well_formed(s) for s in samples])),
        "correct_or_slip_fraction": float(np.mean(correct_or_slip)),
        "held_out_problems": len(held),
        "held_out_greedy_accuracy": float(np.mean(
            [first_int(g) == t for g, t in zip(held_greedy, held_truth[::8])])),
        "held_out_sample_accuracy_T1": float(np.mean(
            [first_int(s) == t for s, t in zip(held_samples, held_truth)])),
        "held_out_correct_or_slip_fraction": float(np.mean(
            [first_int(s) in (t, sl) for s, t, sl in zip(held_samples, held_truth, held_slip)])),
        "examples": list(zip(prompts[:4], greedy[:4], truths[:4])),
    }


def time_rollout_step(model, tok, reps: int = 5) -> dict:
    """Seconds for one RL step's model work: generate 16 x 8 at T=1, then fwd+bwd on them."""
    pool = ArithmeticSource(ArithmeticSource.Config(n=16, seed=0)).load()
    batch = tok([p.text for p in pool for _ in range(8)], return_tensors="pt", padding=True)
    gen_t, fb_t = [], []
    for r in range(reps + 1):
        t0 = time.perf_counter()
        with torch.no_grad():
            out = model.generate(**batch, do_sample=True, temperature=1.0, top_k=0,
                                 max_new_tokens=8)
        t1 = time.perf_counter()
        attn = (out != tok.pad_token_id).long()
        logits = model(input_ids=out, attention_mask=attn).logits[:, :-1]
        logp = torch.log_softmax(logits.float(), -1).gather(-1, out[:, 1:, None]).squeeze(-1)
        (-(logp * attn[:, 1:]).sum()).backward()
        model.zero_grad(set_to_none=True)
        t2 = time.perf_counter()
        if r:  # the first round warms up
            gen_t.append(t1 - t0)
            fb_t.append(t2 - t1)
    return {"generate_16x8_s": float(np.median(gen_t)), "fwd_bwd_128_s": float(np.median(fb_t))}


# --------------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=None,
                        help="default gfcr/assets/tiny-arith, or tiny-arith-h<D> with --head-dim D")
    parser.add_argument("--head-dim", type=int, default=HEAD_DIM, choices=(16, 32, 64, 128),
                        help="attention head size (64 for tiny-arith-h64, the vLLM CPU test model)")
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--eval-only", action="store_true", help="evaluate the saved folder")
    args = parser.parse_args()
    if args.out is None:
        args.out = OUT if args.head_dim == HEAD_DIM else OUT.with_name(f"tiny-arith-h{args.head_dim}")

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
        model = build_model(tok, args.head_dim)
        print(f"{sum(p.numel() for p in model.parameters()):,} parameters", flush=True)
        start = time.time()
        train(model, tok, args.steps)
        print(f"trained in {time.time() - start:.0f}s", flush=True)
        args.out.mkdir(parents=True, exist_ok=True)
        model.save_pretrained(args.out, safe_serialization=True)
        tok.save_pretrained(args.out)

    metrics = evaluate(model, tok) | time_rollout_step(model, tok)
    print(json.dumps(metrics, indent=2))


if __name__ == "__main__":
    main()
