"""replay.store figures: add and query throughput and memory at 10k (real all-MiniLM-L6-v2
embeddings), 100k and 1M entries (synthetic embeddings), flat vs IVF vs HNSW recall@10, the
embedder's texts/s, and the store's overhead on a tiny-arith step (side by side, interleaved).

    PYTHONPATH=$PWD HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/replay_store.py \\
        [--sizes 10000,100000,1000000] [--steps 20] [--out benchmarks/results/replay_store.json]

Synthetic embeddings: each text's vector is a seeded Gaussian draw, unit-normalised (no
model); the store's own work (dedup, bookkeeping, FAISS) is the same as with real ones.
Rollouts are 6 tokens long. Memory is the growth of the process's resident set while the
store fills (VmRSS), so it includes Python's own overhead and FAISS's buffers.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import time
from pathlib import Path

import numpy as np

from gfcr.records import Rollout, Segment
from gfcr.stages.common.embedding import load_embedder
from gfcr.stages.replay.rollout_store import ReplayStore, StoreConfig

DIM = 384
BATCH = 128  # a step's worth of rollouts (16 prompts x 8)


class SyntheticEmbedder:
    """A seeded Gaussian unit vector per text (no model): for the store's cost without the embedder's."""

    dim = DIM

    def encode(self, texts, batch_size: int = 64) -> np.ndarray:
        out = np.empty((len(texts), DIM), dtype=np.float32)
        for i, text in enumerate(texts):
            seed = int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")
            v = np.random.default_rng(seed).standard_normal(DIM).astype(np.float32)
            out[i] = v / np.linalg.norm(v)
        return out


def rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def texts(n: int, offset: int = 0) -> list[str]:
    """Distinct arithmetic question-and-answer texts, like tiny-arith's."""
    out = []
    for i in range(offset, offset + n):
        a, b = i % 997, (i * 7919) % 991
        out.append(f"What is {a} + {b}? The answer is {a + b}, since {a} plus {b} is {a + b} (#{i}).")
    return out


def rollouts(n: int, offset: int, answer_texts: list[str]) -> list[Rollout]:
    out = []
    for i in range(n):
        j = offset + i
        pid = f"p:{j // 8}"
        tokens = [j % 50000, (j // 7) % 50000, 3, 4, 5, 6]
        out.append(Rollout(f"{pid}@s0/{j}", f"{pid}@s0", pid, tokens, [Segment(0, 6, 0, np.full(6, -0.5))],
                           text=answer_texts[i], reward=float(j % 2), created_step=j // BATCH))
    return out


def fill(store: ReplayStore, n: int, all_texts: list[str]) -> dict:
    prompts = {f"p:{j}": f"prompt {j}: what is {j % 97} + {j % 89}?" for j in range(n // 8 + 1)}
    before, start = rss_mb(), time.perf_counter()
    for offset in range(0, n, BATCH):
        size = min(BATCH, n - offset)
        store.add(rollouts(size, offset, all_texts[offset:offset + size]), prompts, offset // BATCH, offset // BATCH)
    seconds = time.perf_counter() - start
    return {"entries": len(store), "add_s": seconds, "add_per_s": n / seconds, "rss_growth_mb": rss_mb() - before,
            "store_bytes": store.nbytes, "embed_s": store.embed_seconds}


def query_rate(store: ReplayStore, queries: list[str], k: int = 10) -> float:
    start = time.perf_counter()
    for q in queries:
        store.knn_by_response(q, k)
    return len(queries) / (time.perf_counter() - start)


def store_figures(n: int, real: bool) -> tuple[dict, ReplayStore]:
    embedder = load_embedder() if real else SyntheticEmbedder()
    store = ReplayStore(StoreConfig(background=False, max_entries=None), embedder)
    all_texts = texts(n)
    row = {"n": n, "embeddings": "all-MiniLM-L6-v2" if real else "synthetic", **fill(store, n, all_texts)}
    row["query_per_s"] = query_rate(store, texts(50 if real or n < 1_000_000 else 20, offset=n))
    if real:
        row["embed_texts_per_s"] = (n + n // 8) / store.embed_seconds  # responses and prompts
    return row, store


def recall(base: np.ndarray, queries: np.ndarray, configs: dict[str, StoreConfig], k: int = 10) -> dict:
    """recall@k of each index against exact (flat) search, and its queries/s."""
    from gfcr.stages.replay.vector_index import VectorIndex

    ids = np.arange(len(base), dtype=np.int64)
    exact = VectorIndex(StoreConfig(background=False).index_settings(), DIM)
    exact.add(ids, base)
    truth = exact.search(queries, k)[1]
    out = {}
    for name, config in configs.items():
        index = VectorIndex(config.index_settings(), DIM)
        start = time.perf_counter()
        index.add(ids, base)
        build = time.perf_counter() - start
        start = time.perf_counter()
        found = index.search(queries, k)[1]
        qps = len(queries) / (time.perf_counter() - start)
        hits = sum(len(set(f) & set(t)) for f, t in zip(found, truth))
        out[name] = {"recall_at_10": hits / truth.size, "build_s": build, "query_per_s": qps}
    return out


INDEXES = {
    "flat": StoreConfig(),
    "ivf nlist=64 nprobe=1": StoreConfig(index="ivf", nlist=64, nprobe=1),
    "ivf nlist=64 nprobe=8": StoreConfig(index="ivf", nlist=64, nprobe=8),
    "ivf nlist=256 nprobe=8": StoreConfig(index="ivf", nlist=256, nprobe=8),
    "hnsw M=32 efSearch=64": StoreConfig(index="hnsw", hnsw_m=32, ef_search=64),
}


def clustered(n: int, centres: int = 500, seed: int = 0) -> np.ndarray:
    """Unit vectors around ``centres`` random directions (embeddings of real text cluster too)."""
    rng = np.random.default_rng(seed)
    c = rng.standard_normal((centres, DIM)).astype(np.float32)
    x = c[rng.integers(0, centres, n)] + 1.5 * rng.standard_normal((n, DIM)).astype(np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


STEP_PIPELINES = {  # model -> (the pipeline without a store, the same pipeline with replay.store)
    "tiny-arith": ("pipelines/quickstart.yaml", "pipelines/examples/replay_store_arith.yaml"),
    "smollm2": ("pipelines/grpo_arith_smollm2.yaml", "pipelines/examples/replay_store_smollm2.yaml"),
}


def step_overhead(steps: int, model: str = "tiny-arith", only: list[str] | None = None) -> dict:
    """A pipeline vs the same pipeline + replay.store (embedding in a worker process or a thread of
    this process, in the background or inline), step by step in turn, so that load on the machine
    hits all five alike. ``embed_cpu_s`` is the embedder's CPU time (the worker's, for a process);
    ``main_cpu_s`` the CPU time of this process's threads a step (not the worker's): what the
    store takes from the step's own process, a figure that load on the machine does not inflate."""
    from gfcr.graph import load_pipeline
    from gfcr.runtime.loop.session import build_services
    from gfcr.runtime.loop.local import LocalRunner

    repo = Path(__file__).resolve().parents[1]
    plain, with_store = STEP_PIPELINES[model]
    inline = ["stages.store.with.background=false"]
    variants = {"no store": (repo / plain, []),
                "store, process, background": (repo / with_store, ["stages.store.with.embed_in=process"]),
                "store, process, inline": (repo / with_store, ["stages.store.with.embed_in=process", *inline]),
                "store, thread, background": (repo / with_store, ["stages.store.with.embed_in=thread"]),
                "store, thread, inline": (repo / with_store, ["stages.store.with.embed_in=thread", *inline])}
    if only:
        variants = {name: v for name, v in variants.items() if name == "no store" or name in only}
    runners, times = {}, {}
    for name, (path, overrides) in variants.items():
        pipeline = load_pipeline(path, overrides + ["executor.kind=local", "tracking.mlflow=null"])
        runners[name] = LocalRunner(pipeline, services=build_services(pipeline.spec))
        times[name] = []
    for _ in range(steps):
        for name, runner in runners.items():
            store = getattr(runner.stages.get("store"), "store", None)
            cpu = store.embed_cpu_seconds if store is not None else 0.0
            start, main_cpu = time.perf_counter(), time.process_time()
            report = runner.run_step()
            seconds, main_cpu = time.perf_counter() - start, time.process_time() - main_cpu
            # a background add's embedding ends during the next step: its CPU time is counted one step late
            embed_cpu = (store.embed_cpu_seconds - cpu) if store is not None else 0.0
            times[name].append((seconds, report.stage_seconds.get("store", 0.0), embed_cpu, main_cpu))
    out = {}
    for name, rows in times.items():
        rows = rows[min(2, steps // 3):]  # warm-up
        out[name] = {"step_s_median": float(np.median([r[0] for r in rows])),
                     "store_stage_s": float(np.mean([r[1] for r in rows])),
                     "embed_cpu_s": float(np.mean([r[2] for r in rows])),
                     "main_cpu_s": float(np.mean([r[3] for r in rows]))}
    for name, runner in runners.items():  # a worker's encode may end during another pipeline's step
        store = getattr(runner.stages.get("store"), "store", None)
        if store is not None:
            store.finish()
            out[name]["embed_cpu_s_all_steps"] = store.embed_cpu_seconds / steps
    base, base_cpu = out["no store"]["step_s_median"], out["no store"]["main_cpu_s"]
    for name in out:
        out[name]["wall_overhead"] = out[name]["step_s_median"] / base - 1
        out[name]["main_cpu_overhead"] = out[name]["main_cpu_s"] / base_cpu - 1
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", default="10000,100000,1000000")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--model", choices=sorted(STEP_PIPELINES), default="tiny-arith",
                        help="whose step the store's overhead is measured against")
    parser.add_argument("--overhead-only", action="store_true", help="skip the store, recall figures")
    parser.add_argument("--variants", nargs="+", default=None,
                        help="the store variants to step beside `no store` (default: all four), e.g. 'store, process, background'")
    parser.add_argument("--out", default="benchmarks/results/replay_store.json")
    args = parser.parse_args()
    results: dict = {"model": args.model, "overhead": step_overhead(args.steps, args.model, args.variants)}
    print(json.dumps(results["overhead"], indent=1), flush=True)
    if args.overhead_only:
        Path(args.out).write_text(json.dumps(results, indent=1) + "\n")
        return
    sizes = [int(s) for s in args.sizes.split(",")]
    results["store"] = []
    for n in sizes:
        row, store = store_figures(n, real=(n == sizes[0]))
        results["store"].append(row)
        print(json.dumps(row), flush=True)
        if n == sizes[0]:  # the real embeddings, for recall
            real = store.responses.vectors(np.arange(len(store), dtype=np.int64))
        del store
    held = len(real) // 50
    results["recall_real"] = recall(real[:-held], real[-held:], INDEXES)
    print(json.dumps(results["recall_real"], indent=1), flush=True)
    synthetic = clustered(100_200)
    results["recall_clustered_100k"] = recall(synthetic[:100_000], synthetic[100_000:], INDEXES)
    print(json.dumps(results["recall_clustered_100k"], indent=1), flush=True)
    Path(args.out).write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
