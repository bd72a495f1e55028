"""A multi-node worker's engine arguments (llm_batch.runtime.multinode) and the leader's flags."""

from __future__ import annotations

import pytest

from llm_batch.runtime.multinode import NodeGroup, NodeGroupError
from llm_batch.runtime.worker import WorkerUsageError, parse_config

GROUP = NodeGroup(nnodes=2, node_rank=1, master_addr="leader.grp", master_port=29600, gpus_per_node=4)


def test_tensor_parallel_inside_a_node_pipeline_parallel_across():
    args = GROUP.engine_args({"model": "/m", "max_model_len": 512})
    assert args == {"model": "/m", "max_model_len": 512, "tensor_parallel_size": 4, "pipeline_parallel_size": 2,
                    "distributed_executor_backend": "mp", "nnodes": 2, "node_rank": 1,
                    "master_addr": "leader.grp", "master_port": 29600}


def test_sizes_the_job_sets_must_fill_the_group():
    assert GROUP.engine_args({"tensor_parallel_size": 8, "pipeline_parallel_size": 1})["tensor_parallel_size"] == 8
    with pytest.raises(NodeGroupError, match="tensor_parallel_size 2 x pipeline_parallel_size 2 = 4 ranks.*= 8"):
        GROUP.engine_args({"tensor_parallel_size": 2})


@pytest.mark.parametrize(("changes", "message"), [
    ({"nnodes": 1}, "--nnodes must be >= 2"),
    ({"node_rank": 2}, "--node-rank must be in 0..1"),
    ({"master_addr": ""}, "--master-addr is required"),
    ({"gpus_per_node": 0}, "--gpus-per-node must be >= 1"),
])
def test_a_group_that_cannot_be_is_refused(changes, message):
    values = {"nnodes": 2, "node_rank": 0, "master_addr": "a", "master_port": 1, "gpus_per_node": 1, **changes}
    with pytest.raises(NodeGroupError, match=message):
        NodeGroup(**values).check()


def _leader(**flags):
    return parse_config(job_id="job_1", shard=0, requests=None, results=None, endpoint="/v1/chat/completions",
                        model_config='{"model": "m"}', work_uri="/tmp/w", **flags)


def test_the_leaders_flags():
    assert _leader().node_group is None  # a one-node worker
    config = _leader(nnodes="3", master_addr="lws-0.lws.ns", master_port=None, gpus_per_node="2")
    assert config.node_group == NodeGroup(nnodes=3, node_rank=0, master_addr="lws-0.lws.ns", gpus_per_node=2)
    assert config.node_group.leader
    with pytest.raises(WorkerUsageError, match="--nnodes: not an integer"):
        _leader(nnodes="two", master_addr="a")
    with pytest.raises(WorkerUsageError, match="--master-addr is required"):
        _leader(nnodes=2)
