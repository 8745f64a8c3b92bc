"""Replay stages: reuse of earlier rollouts without new weight updates (the R of GFCR).

``replay.store`` keeps a step's rollouts in a FAISS-indexed store (``rollout_store.ReplayStore``)
that other Replay stages query, its text embedder loaded offline by ``gfcr.stages.common.embedding``."""
