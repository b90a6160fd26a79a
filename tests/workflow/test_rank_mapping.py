"""Ranks are given bundles node by node (``placement.ranks_by_node``), from synthetic bundle -> node maps like
``ray.util.placement_group_table(pg)["bundles_to_node_id"]``: a TP (TP x EP) group never spans nodes."""

import pytest

from asyncflow.config import ConfigError, MegatronConfig
from asyncflow.workflow.placement import node_unit, ranks_by_node


def _nodes_of(order, bundle_nodes):
    return [bundle_nodes[b] for b in order]


def test_interleaved_bundles_keep_each_tp_group_on_one_node():
    # PACK may interleave nodes: rank r -> bundle r would put TP group (0, 1) on nodes A and B.
    bundle_nodes = {0: "A", 1: "B", 2: "A", 3: "B"}
    order = ranks_by_node(bundle_nodes, [0, 1, 2, 3], unit=2, what="trainer TP 2")
    nodes = _nodes_of(order, bundle_nodes)
    assert sorted(order) == [0, 1, 2, 3]
    assert all(len(set(nodes[i:i + 2])) == 1 for i in range(0, 4, 2)), nodes


def test_a_group_after_the_rollout_bundles_fills_node_by_node():
    # Bundles 0-1 are rollout engines; the trainer's 8 ranks (TP 4) have bundles 2-9 over two nodes.
    bundle_nodes = {0: "B", 1: "B", 2: "B", 3: "A", 4: "B", 5: "A", 6: "A", 7: "B", 8: "A", 9: "B"}
    order = ranks_by_node(bundle_nodes, list(range(2, 10)), unit=4, what="trainer TP 4")
    nodes = _nodes_of(order, bundle_nodes)
    assert sorted(order) == list(range(2, 10))
    assert nodes == ["B"] * 4 + ["A"] * 4


def test_tp_times_ep_is_the_unit_of_moe_trainers():
    assert node_unit(MegatronConfig(tensor_parallel=2, expert_parallel=2)) == 4
    assert node_unit(MegatronConfig(tensor_parallel=4)) == 4
    bundle_nodes = {0: "A", 1: "A", 2: "B", 3: "B"}
    with pytest.raises(ConfigError, match="4 consecutive ranks on one node"):
        ranks_by_node(bundle_nodes, [0, 1, 2, 3], unit=4, what="trainer TP 2 x EP 2")


def test_tp_larger_than_a_node_is_a_clear_error():
    # TP 4 with 2 devices per node: no layout keeps a TP group on one node.
    bundle_nodes = {0: "A", 1: "A", 2: "B", 3: "B"}
    with pytest.raises(ConfigError, match=r"trainer TP 4 needs 4 consecutive ranks on one node.*2 of its 4 devices"):
        ranks_by_node(bundle_nodes, [0, 1, 2, 3], unit=4, what="trainer TP 4")


def test_nodes_follow_the_given_order():
    # The placement orders nodes by address: the same hosts get the same ranks in every run.
    bundle_nodes = {0: "B", 1: "B", 2: "A", 3: "A"}
    order = ranks_by_node(bundle_nodes, [0, 1, 2, 3], unit=2, what="trainer TP 2", node_rank={"A": 1, "B": 2})
    assert order == [2, 3, 0, 1]
