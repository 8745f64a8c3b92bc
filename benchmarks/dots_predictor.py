"""How well ``control.dots`` predicts success rates: the trained predictor against the untrained
LayerNorm attention the stage used before it (issue 29), on tiny-arith's initial policy.

For each seed: the 400-prompt pool of ``pipelines/dots_arith.yaml``, every prompt's success rate
from 16 samples (the truth), a reference set of K prompts and T training prompts (4 samples
each, as the pipeline), the predictor trained as the stage trains it, then p_hat (after the
reference set's linear calibration) compared with the truth on the held-out prompts (the pool
minus the K + T). MAE(ref mean) predicts the reference set's mean accuracy for every prompt.

Command (from the repo root; about 3 minutes at 20 epochs, 25 at 200 on 2 shared cores)::

    OMP_NUM_THREADS=1 PYTHONPATH=$PWD HF_HUB_OFFLINE=1 python benchmarks/dots_predictor.py --epochs 20
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from scipy.stats import pearsonr, spearmanr

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from gfcr.graph import load_pipeline  # noqa: E402
from gfcr.records import StepContext  # noqa: E402
from gfcr.runtime.loop.session import Run  # noqa: E402
from gfcr.stages.control.dots import _REFERENCE, Dots, linear_calibration  # noqa: E402

SETTINGS = [(16, 128), (64, 256)]  # (K reference prompts, T training prompts)


def layer_norm_attention(embeddings: np.ndarray, ref_rows: list[int], acc: np.ndarray) -> np.ndarray:
    """The untrained predictor this stage had before: LayerNorm, dot product / sqrt(d), softmax, calibration."""
    def ln(x):
        return (x - x.mean(-1, keepdims=True)) / np.sqrt(x.var(-1, keepdims=True) + 1e-5)
    q, r = ln(embeddings.astype(np.float64)), ln(embeddings[ref_rows].astype(np.float64))
    scores = q @ r.T / np.sqrt(q.shape[1])
    w = np.exp(scores - scores.max(1, keepdims=True))
    p = (w / w.sum(1, keepdims=True)) @ acc
    a, b = linear_calibration(p[ref_rows], acc)
    return a * p + b


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--seeds", type=int, default=5)
    args = parser.parse_args()
    run = Run.start(load_pipeline(ROOT / "pipelines" / "dots_arith.yaml", ["tracking.mlflow=null", "executor.kind=local"]),
                    Path(tempfile.mkdtemp()) / "run")
    pool, n = run.pool, len(run.pool)

    def stage(**kw) -> Dots:
        s = Dots(Dots.Config(batch_size=16, interval=2, fresh_fraction=1.0, temperature=1.0, max_new_tokens=8, **kw))
        s.setup(run.services.lent)
        s.before_step(StepContext("bench", 0, 0, 0))
        return s

    truth = stage(reference_prompts=2, reference_samples=16, seed=0).reference_accuracies(list(pool))
    print(f"truth: mean {truth.mean():.3f}, std {truth.std():.3f} over {n} prompts")
    rows = []
    for k, t in SETTINGS:
        for seed in range(args.seeds):
            s = stage(reference_prompts=k, reference_samples=4, train_prompts=t, train_epochs=args.epochs, seed=seed)
            s.embed(pool)
            drawn = np.random.default_rng([seed, 0, _REFERENCE]).permutation(n)  # the stage's first-round draw
            ref_rows, train_rows = sorted(drawn[:k].tolist()), sorted(drawn[k:k + t].tolist())
            held = sorted(drawn[k + t:].tolist())
            acc_all = s.reference_accuracies([pool[i] for i in ref_rows + train_rows])
            acc = acc_all[:k]
            start = time.time()
            s.train(pool, ref_rows, acc, train_rows, acc_all[k:])
            seconds = time.time() - start
            _, p_hat, _ = s.predict(pool, ref_rows, acc)
            p_old = layer_norm_attention(s._vectors(pool, range(n)).numpy(), ref_rows, acc)
            y = truth[held]
            for name, p in (("trained", p_hat), ("untrained", p_old)):
                rows.append((k, t, name, pearsonr(p[held], y)[0], spearmanr(p[held], y)[0],
                             float(np.abs(p[held] - y).mean()), float(np.abs(acc.mean() - y).mean()), seconds))
                print(k, t, seed, *rows[-1][2:], flush=True)
    print(f"\n| K | T | predictor | Pearson | Spearman | MAE | MAE(ref mean) | train s |  ({args.epochs} epochs, "
          f"mean of {args.seeds} seeds)\n|---|---|---|---|---|---|---|---|")
    for k, t in SETTINGS:
        for name in ("trained", "untrained"):
            m = np.array([r[3:] for r in rows if r[:3] == (k, t, name)]).mean(0)
            print(f"| {k} | {t} | {name} | {m[0]:.3f} | {m[1]:.3f} | {m[2]:.3f} | {m[3]:.3f} | "
                  f"{m[4] if name == 'trained' else 0:.1f} |")
    run.services.close()


if __name__ == "__main__":
    main()
