"""A rollout kept in a stage's state (a buffer, a checkpoint) keeps where it was generated: the
engine replica and the Ray node it ran on (issue 32: every rollout's lineage records both)."""

from __future__ import annotations

from gfcr.runtime.store.state_tree import read_tree, write_tree
from gfcr.stages.generate.rollout_state import rollout_from_state, rollout_state
from gfcr.stages.testing import scored_group

NODE = "7fce1a393d80a8ba470f2f2360cdbf666e86072b36ac0ac6eecf31aa"  # a Ray node id: 56 hex digits


def test_replica_and_ray_node_survive_a_checkpoint(tmp_path):
    (rollout,) = scored_group("p:0", [1.0]).rollouts
    rollout.replica, rollout.ray_node = "ray-1", NODE
    write_tree({"rollouts": [rollout_state(rollout)]}, tmp_path)
    (back,) = [rollout_from_state(d) for d in read_tree(tmp_path)["rollouts"]]
    assert (back.replica, back.ray_node) == ("ray-1", NODE)
    assert rollout_state(back).keys() == rollout_state(rollout).keys()


def test_a_checkpoint_written_before_nodes_were_recorded_loads_without_one():
    (rollout,) = scored_group("p:0", [0.0]).rollouts
    rollout.replica = "ray-0"
    old = {key: value for key, value in rollout_state(rollout).items() if key != "ray_node"}
    assert (rollout_from_state(old).replica, rollout_from_state(old).ray_node) == ("ray-0", None)
