"""One shard worker spanning several nodes: each node's vLLM engine arguments, and the
follower's part.

One vLLM engine over ``nnodes`` processes joined by vLLM's multi-node multiprocessing
executor (no Ray): tensor parallel inside a node, pipeline parallel across nodes. Node 0
runs the shard worker (``llm-batch worker ... --nnodes N``); the others run ``llm-batch
worker-follower``, vLLM's headless workers, until the leader's engine goes away.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from llm_batch.core import exit_codes
from llm_batch.runtime.engine import vllm_api

if TYPE_CHECKING:
    from llm_batch.infra.model_resolution import ResolvedModel

log = logging.getLogger("llm_batch.runtime.multinode")

# torch.distributed's rendezvous on the leader (vLLM's default master_port).
DEFAULT_MASTER_PORT = 29501


class NodeGroupError(ValueError):
    """A node group vLLM cannot form as asked (a usage error: retrying will not help)."""


@dataclass(frozen=True)
class NodeGroup:
    """This process's place in a multi-node worker."""

    nnodes: int
    node_rank: int
    master_addr: str
    master_port: int = DEFAULT_MASTER_PORT
    gpus_per_node: int = 1

    @property
    def leader(self) -> bool:
        return self.node_rank == 0

    def check(self) -> None:
        if self.nnodes < 2:
            raise NodeGroupError(f"--nnodes must be >= 2 for a multi-node worker, got {self.nnodes}")
        if not 0 <= self.node_rank < self.nnodes:
            raise NodeGroupError(f"--node-rank must be in 0..{self.nnodes - 1}, got {self.node_rank}")
        if not self.master_addr:
            raise NodeGroupError("--master-addr is required (the leader's address)")
        if self.gpus_per_node < 1:
            raise NodeGroupError(f"--gpus-per-node must be >= 1, got {self.gpus_per_node}")

    def engine_args(self, args: dict[str, Any]) -> dict[str, Any]:
        """``args`` (``vllm.LLM`` keywords) for this node: tensor parallel over its GPUs and
        pipeline parallel over the nodes unless set, and then they must fill the group exactly."""
        tp = int(args.get("tensor_parallel_size") or self.gpus_per_node)
        pp = int(args.get("pipeline_parallel_size") or self.nnodes)
        if tp * pp != self.gpus_per_node * self.nnodes:
            raise NodeGroupError(
                f"tensor_parallel_size {tp} x pipeline_parallel_size {pp} = {tp * pp} ranks, but the worker "
                f"has {self.nnodes} nodes x {self.gpus_per_node} GPUs = {self.nnodes * self.gpus_per_node}: "
                "they must be equal"
            )
        return {
            **args,
            "tensor_parallel_size": tp,
            "pipeline_parallel_size": pp,
            "distributed_executor_backend": "mp",
            "nnodes": self.nnodes,
            "node_rank": self.node_rank,
            "master_addr": self.master_addr,
            "master_port": self.master_port,
        }

    def model_for_node(self, model: ResolvedModel) -> ResolvedModel:
        return replace(model, engine_args=self.engine_args(model.engine_args))


def run_follower(model: ResolvedModel, group: NodeGroup) -> int:
    """Join the leader's engine with ``model`` (resolved as the leader resolves it) as node
    ``group.node_rank`` until it ends: USAGE for a group that cannot be, FAILED when the
    engine's workers on this node die, DONE when they end."""
    if group.leader:
        log.error("node rank 0 is the leader: it runs `llm-batch worker`, not a follower")
        return exit_codes.USAGE
    try:
        model = group.model_for_node(model)
    except NodeGroupError as exc:
        log.error("follower node %d cannot run: %s", group.node_rank, exc)
        return exit_codes.USAGE

    log.info("follower node %d of %d joining %s:%d for model %s", group.node_rank, group.nnodes,
             group.master_addr, group.master_port, model.name)
    try:
        vllm_api.serve_headless_node(model.engine_args)
    except SystemExit:  # vLLM's own SIGTERM handler: the pod is stopping
        return exit_codes.DONE
    except Exception:
        log.exception("follower node %d failed", group.node_rank)
        return exit_codes.FAILED
    return exit_codes.DONE
