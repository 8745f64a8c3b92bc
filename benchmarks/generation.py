"""Generation benchmark (issue 10, Must show 2): SmolLM2 on GSM8K prompts, side by side in one run.

Columns, all on the same prompts and the same process:

- ``old_generate``: the v1 engine's path, kept here verbatim as the baseline: one
  ``model.generate`` per batch with ``output_logits=True`` (every step's ``[B, V]`` logits
  kept, log-probs computed afterwards), a batch waiting for its longest row;
- ``decode_loop``: the v2 ``TransformersEngine`` (KV-cached step loop, finished rows leave
  the batch, last-position logits only);
- ``peer_hand_loop``: the generation call of ``../shared/peers/trl_cpu/hand_grpo.py``
  (``model.generate``, no logits kept; its log-probs are recomputed later in its update, not
  timed here);
- APRIL: ``2 x prompts`` groups over-provisioned on the decode loop, ``wait_all`` (every
  group to the end) vs ``stop_at_target`` (``control.stop_at_target`` with ``groups =
  prompts``: the rest aborted, partials kept).

Tokens/s counts generated tokens (an aborted partial's tokens included: they are kept and
resumed). Results go to ``benchmarks/results/generation.json``.

Full run (the issue's workload; minutes on CPU):
    PYTHONPATH=. HF_HUB_OFFLINE=1 python benchmarks/generation.py
Smoke run:
    PYTHONPATH=. HF_HUB_OFFLINE=1 python benchmarks/generation.py --prompts 2 --samples 2 --max-new-tokens 16
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

from gfcr.engines import TransformersEngine, load_policy
from gfcr.engines.hf import left_pad
from gfcr.records import Prompt
from gfcr.spec import PolicySpec
from gfcr.stages.control.stop_at_target import StopAtTarget
from gfcr.stages.data.gsm8k import default_path
from gfcr.stages.engine import GenerationRequest, SamplingParams

REPO = Path(__file__).resolve().parents[1]
GSM8K = [default_path("train"),  # $GFCR_GSM8K_DIR, else ../shared beside the working directory
         REPO.parent / "shared" / "data" / "gsm8k" / "train.jsonl", Path("/work/shared/data/gsm8k/train.jsonl")]


def old_generate(policy: Any, rows: list[tuple[int, ...]], params: SamplingParams) -> list[tuple[int, ...]]:
    """The v1 engine's batch (gfcr.engines.hf before contract v2), trimmed to what it computed."""
    tok, model = policy.tokenizer, policy.model
    input_ids, attention = (t.to(policy.device) for t in left_pad(rows, tok.pad_token_id))
    torch.manual_seed(params.seed)
    out = model.generate(input_ids=input_ids, attention_mask=attention, do_sample=True,
                         max_new_tokens=params.max_new_tokens, eos_token_id=policy.eos_token_id,
                         pad_token_id=tok.pad_token_id, return_dict_in_generate=True, output_logits=True,
                         temperature=params.temperature, top_p=params.top_p, top_k=0)
    new = out.sequences[:, input_ids.shape[1]:]  # [B, T]
    logits = torch.stack(out.logits, dim=1).float() / params.temperature  # [B, T, V]
    torch.log_softmax(logits, dim=-1).gather(-1, new.unsqueeze(-1)).squeeze(-1)  # [B, T]
    return [cut_at_eos(row.tolist(), policy.eos_token_id) for row in new]


def peer_generate(policy: Any, rows: list[tuple[int, ...]], params: SamplingParams) -> list[tuple[int, ...]]:
    """hand_grpo.py's generation call on the same token ids (its prompts, left-padded)."""
    tok, model = policy.tokenizer, policy.model
    input_ids, attention = (t.to(policy.device) for t in left_pad(rows, tok.pad_token_id))
    torch.manual_seed(params.seed)
    out = model.generate(input_ids=input_ids, attention_mask=attention, do_sample=True, temperature=1.0, top_k=0,
                         top_p=1.0, max_new_tokens=params.max_new_tokens, pad_token_id=tok.pad_token_id,
                         eos_token_id=policy.eos_token_id)
    return [cut_at_eos(row.tolist(), policy.eos_token_id) for row in out[:, input_ids.shape[1]:]]


def cut_at_eos(ids: list[int], eos: int) -> tuple[int, ...]:
    return tuple(ids[:ids.index(eos) + 1] if eos in ids else ids)


def timed(name: str, fn: Callable[[], Any]) -> tuple[Any, float]:
    start = time.perf_counter()
    with torch.no_grad():
        out = fn()
    wall = time.perf_counter() - start
    print(f"{name}: {wall:.1f}s", file=sys.stderr, flush=True)
    return out, wall


def column(wall: float, lengths: list[int], **extra: Any) -> dict[str, Any]:
    tokens = sum(lengths)
    return dict(wall_s=round(wall, 3), rows=len(lengths), tokens=tokens, tokens_per_s=round(tokens / wall, 2),
                mean_len=round(tokens / max(1, len(lengths)), 1), max_len=max(lengths, default=0), **extra)


def load_questions(count: int) -> list[str]:
    path = next((p for p in GSM8K if p.exists()), None)
    if path is None:
        raise SystemExit(f"GSM8K train.jsonl not found at {[str(p) for p in GSM8K]}")
    with path.open() as f:
        return [json.loads(line)["question"] for _, line in zip(range(count), f)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="where the policy runs (policy.device)")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--skip-old", action="store_true", help="skip the model.generate columns")
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "generation.json")
    args = ap.parse_args()

    start = time.perf_counter()
    policy = load_policy(PolicySpec(model=args.model, device=args.device))
    print(f"loaded {args.model}: {time.perf_counter() - start:.1f}s", file=sys.stderr, flush=True)
    policy.model.eval()
    questions = load_questions(2 * args.prompts)
    prompts = [tuple(policy.encode(Prompt(f"gsm8k:{i}", messages=[{"role": "user", "content": q}])))
               for i, q in enumerate(questions)]
    params = SamplingParams(temperature=1.0, max_new_tokens=args.max_new_tokens, seed=args.seed)
    requests = [GenerationRequest(f"g{i}", p, args.samples, params) for i, p in enumerate(prompts)]
    engine = TransformersEngine(policy)
    rows = [p for p in prompts[:args.prompts] for _ in range(args.samples)]
    results: dict[str, Any] = dict(model=args.model, prompts=args.prompts, samples=args.samples,
                                   max_new_tokens=args.max_new_tokens, threads=torch.get_num_threads(),
                                   machine=platform.processor() or platform.machine(), device=args.device,
                                   gpu=torch.cuda.get_device_name(0) if args.device == "cuda" else None)

    def new_loop(reqs, **kw):
        out = engine.generate(reqs, **kw)
        return [c for g in out for c in g]

    done, wall = timed("decode_loop", lambda: new_loop(requests[:args.prompts]))
    results["decode_loop"] = column(wall, [len(c.token_ids) for c in done])
    if not args.skip_old:
        done_old, wall = timed("old_generate", lambda: old_generate(policy, rows, params))
        results["old_generate"] = column(wall, [len(t) for t in done_old])
        done_peer, wall = timed("peer_hand_loop", lambda: peer_generate(policy, rows, params))
        results["peer_hand_loop"] = column(wall, [len(t) for t in done_peer])
    done, wall = timed("april_wait_all", lambda: new_loop(requests))
    results["april_wait_all"] = column(wall, [len(c.token_ids) for c in done], groups=len(requests))
    stop = StopAtTarget(StopAtTarget.Config(groups=args.prompts))
    done, wall = timed("april_stop_at_target", lambda: new_loop(requests, controller=stop))
    reasons = [c.finish_reason for c in done]
    results["april_stop_at_target"] = column(wall, [len(c.token_ids) for c in done], groups=len(requests),
                                             aborted_rows=reasons.count("aborted"))
    results["ratios"] = ratios(results)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps(results, indent=2))


def ratios(r: dict[str, Any]) -> dict[str, float]:
    def tps(name: str) -> float | None:
        return r[name]["tokens_per_s"] if name in r else None

    out = {}
    pairs = [("decode_loop_vs_old_generate", "decode_loop", "old_generate"),
             ("decode_loop_vs_peer_hand_loop", "decode_loop", "peer_hand_loop"),
             ("stop_at_target_vs_wait_all", "april_stop_at_target", "april_wait_all"),
             ("stop_at_target_vs_old_generate", "april_stop_at_target", "old_generate")]
    for key, a, b in pairs:
        if tps(a) and tps(b):
            out[f"{key}_tokens_per_s"] = round(tps(a) / tps(b), 3)
    out["stop_at_target_vs_wait_all_wall"] = round(r["april_stop_at_target"]["wall_s"] / r["april_wait_all"]["wall_s"], 3)
    return out


if __name__ == "__main__":
    main()
