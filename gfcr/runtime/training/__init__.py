"""Training, as the runtime runs it: the trainer that calls an update stage's ``prepare``,
``train_shard`` and ``finish`` (in this process, or over trainer ranks), bumps the policy version
and hands it to a weight mover (``gfcr.runtime.weights``)."""

from gfcr.runtime.training.trainer import (
    LocalTrainer, RankTrainer, TrainerGroup, WeightMover, split_balanced,
)

__all__ = ["LocalTrainer", "RankTrainer", "TrainerGroup", "WeightMover", "split_balanced"]
