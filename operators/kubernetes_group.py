"""ShardGroupOperator: one shard whose worker spans several nodes, as a LeaderWorkerSet.

Built by KubernetesShardOperator for ``nodes_per_worker > 1`` (imported only when such a
shard runs: the Kubernetes client is slow to import). The set's shape is ``group_spec``'s;
this module is its life:

1. Sets of this shard left by an earlier attempt (a task killed with no time to clean up)
   are deleted first: two groups must never work on one shard.
2. A fresh set is created (a new name per attempt).
3. While it runs, the operator supervises it as the local runner supervises a process:
   each round it reports the shard's progress, mirrors a cancel to the marker the leader's
   worker reads, and reads the group's pods. The leader's exit code (its container's
   ``state`` or, once restarted, ``lastState``) is the shard's outcome. A follower that
   exits or restarts, a pod replaced, the set deleted by someone else, or a group not
   running ``startup_timeout_seconds`` after creation fails the attempt. A worker still
   running ``cancel_grace_seconds`` after a cancel or the deadline is stopped (the set
   deleted) and the shard ends cancelled / deadline.
4. The set is deleted however the attempt ends (``propagationPolicy: Foreground``: the
   StatefulSets and every pod of the group go with it), and on kill.

A failed attempt raises, so the task's retry makes a new group, which resumes from the
shard's checkpoint as a single pod does. Not deferrable: the task holds its worker slot
while the group runs (multi-node shards are few and long).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from airflow.sdk import BaseOperator
from kubernetes.client.exceptions import ApiException

from llm_batch import exit_codes
from llm_batch.shard_task import ShardOutcome, ShardTask
from llm_batch_operators import group_spec
from llm_batch_operators.shard import ShardTaskMixin, error_tail

POLL_SECONDS = 5.0
STARTUP_TIMEOUT_S = 900  # image pulls of a vLLM image are slow (as the single pod's)
STALE_WAIT_S = 120.0  # how long an old attempt's set may take to go
LOG_TAIL_LINES = 20  # of the pod whose exit decided, into the task log (and a failure's message)
# The pod operator's overrides that also apply here; the others (deferrable, ...) do not.
HOOK_ARGS = ("kubernetes_conn_id", "config_file", "in_cluster", "cluster_context")


@dataclass(frozen=True)
class GroupState:
    """What one read of the group found."""

    leader_exit: int | None = None  # the leader's container has exited with this code
    failure: str | None = None  # the group broke (and why)
    usage: bool = False  # ... because a follower refused its arguments
    running: bool = False  # every pod of the group is running
    pod: str | None = None  # the pod whose exit decided, and whether its container has
    restarted: bool = False  # restarted since (its log is then the previous container's)


class ShardGroupOperator(ShardTaskMixin, BaseOperator):
    """Run one shard (``shard_task``: a ``llm_batch.shard_task.ShardTask`` as a dict, with
    ``nodes_per_worker > 1``) as a LeaderWorkerSet; see the module docstring.

    ``kubernetes_conn_id`` / ``config_file`` / ``in_cluster`` / ``cluster_context``: the
    cluster (KubernetesHook's arguments; default: the settings' connection). Returns the
    shard's outcome dict; a failed attempt raises for a retry, a usage error fails without.
    """

    template_fields = ("shard_task",)
    ui_color = "#e8eef8"

    def __init__(self, *, shard_task: dict[str, Any], poll_interval: float = POLL_SECONDS,
                 startup_timeout_seconds: float = STARTUP_TIMEOUT_S, **kwargs: Any) -> None:
        self.hook_args = {name: kwargs.pop(name) for name in HOOK_ARGS if name in kwargs}
        for name in ("deferrable", "namespace"):  # pod-operator overrides with no meaning here
            kwargs.pop(name, None)
        super().__init__(**kwargs)
        self.shard_task = shard_task
        self.poll_interval = poll_interval
        self.startup_timeout_seconds = startup_timeout_seconds
        self.set_name: str | None = None
        self._killed = threading.Event()
        self._uids: dict[str, str] = {}  # worker index -> the uid of its pod when first seen

    # -- the cluster ------------------------------------------------------------------

    @property
    def namespace(self) -> str:
        return self.llm_settings.k8s_namespace

    def hook(self) -> Any:
        from airflow.providers.cncf.kubernetes.hooks.kubernetes import KubernetesHook

        if getattr(self, "_hook", None) is None:
            args = {"conn_id": self.llm_settings.k8s_conn_id, **self.hook_args}
            if "kubernetes_conn_id" in args:
                args["conn_id"] = args.pop("kubernetes_conn_id")
            self._hook = KubernetesHook(**args)
        return self._hook

    def _objects(self) -> Any:
        return self.hook().custom_object_client

    # -- execute ------------------------------------------------------------------------

    def execute(self, context: Any) -> dict[str, Any]:
        task = self.shard
        early = self.stop_before_start()
        if early is not None:
            return self.report_outcome(early, context).model_dump()
        self._delete_stale(task)
        name = group_spec.set_name(task)
        body = group_spec.leader_worker_set(task, self.llm_settings, name)
        self.log.info("shard %s: creating LeaderWorkerSet %s (%s nodes x %s GPUs)", task.shard, name,
                      task.nodes_per_worker, task.gpus)
        self.set_name = name  # before the call: a kill while it is on its way deletes it too
        try:
            self._objects().create_namespaced_custom_object(group_spec.GROUP, group_spec.VERSION, self.namespace,
                                                            group_spec.PLURAL, body)
        except ApiException as exc:
            if exc.status not in (404, 422):
                raise  # the API server failing: worth a retry
            why = ("the cluster serves no LeaderWorkerSet API (leaderworkerset.x-k8s.io/v1): install the LWS "
                   "controller (https://github.com/kubernetes-sigs/lws) to run nodes_per_worker > 1"
                   if exc.status == 404 else f"the cluster refused the LeaderWorkerSet: {_api_message(exc)}")
            return self.finish(self._failed(why, usage=True), context)
        try:
            outcome = self._supervise(task, name)
        finally:
            self.delete_group()
        return self.finish(outcome, context)

    def on_kill(self) -> None:
        self._killed.set()
        if self.set_name is not None:
            self.log.info("task killed: deleting LeaderWorkerSet %s", self.set_name)
            self.delete_group()

    # -- supervision ------------------------------------------------------------------

    def _supervise(self, task: ShardTask, name: str) -> ShardOutcome:
        grace = self.llm_settings.cancel_grace_seconds
        created = time.monotonic()
        stop_seen: tuple[str, float] | None = None
        ever_running = False
        while True:
            if self._killed.is_set():
                return self._failed("the task was killed", exit_code=-9)
            self.report_progress()
            state = self.group_state(name)
            if state.leader_exit is not None or state.failure is not None:
                tail = self._log_tail(state)
                if state.leader_exit is not None:
                    outcome = self.outcome(state.leader_exit, None)
                else:
                    outcome = self._failed(state.failure or "", usage=state.usage)
                if outcome.state in ("failed", "usage") and tail:
                    outcome = outcome.model_copy(update={"message": f"{outcome.message}: {tail}"})
                return outcome
            ever_running = ever_running or state.running
            if not ever_running and time.monotonic() - created > self.startup_timeout_seconds:
                return self._failed(f"the group of {task.nodes_per_worker} pods was not running "
                                    f"{self.startup_timeout_seconds:.0f}s after it was created")
            if stop_seen is None:
                cause = self.stop_cause(datetime.now(UTC))
                if cause is not None:
                    self.log.info("shard %s: %s; waiting up to %ss for the leader", task.shard, cause, grace)
                    stop_seen = (cause, time.monotonic())
            elif time.monotonic() - stop_seen[1] > grace:
                self.log.warning("leader did not stop %ss after %s: deleting the group", grace, stop_seen[0])
                return self.outcome(None, stop_seen[0])
            self._killed.wait(self.poll_interval)

    def _failed(self, why: str, *, usage: bool = False, exit_code: int = exit_codes.FAILED) -> ShardOutcome:
        return ShardOutcome(shard=self.shard.shard, exit_code=exit_codes.USAGE if usage else exit_code,
                            state="usage" if usage else "failed",
                            message=f"multi-node worker failed: {why}" + ("" if usage else "; a retry makes a new group and resumes"))

    def group_state(self, name: str) -> GroupState:
        """One read of the set and its pods (see the module docstring for the verdicts)."""
        try:
            self._objects().get_namespaced_custom_object(group_spec.GROUP, group_spec.VERSION, self.namespace,
                                                         group_spec.PLURAL, name)
        except ApiException as exc:
            if exc.status == 404:
                return GroupState(failure=f"LeaderWorkerSet {name} was deleted while the shard ran")
            raise
        pods = self.hook().core_v1_client.list_namespaced_pod(
            self.namespace, label_selector=group_spec.group_selector(name)).items
        size = self.shard.nodes_per_worker
        by_index = {int((pod.metadata.labels or {}).get(group_spec.WORKER_INDEX_LABEL, -1)): pod for pod in pods}
        leader = by_index.get(0)
        if leader is not None and (code := _exit_code(leader)) is not None:
            return GroupState(leader_exit=code, pod=leader.metadata.name, restarted=_restarted(leader))
        for index, uid in self._uids.items():
            pod = by_index.get(int(index))
            if pod is None or pod.metadata.uid != uid:
                return GroupState(failure=f"pod {index} of the group was deleted or replaced")
        if leader is not None and leader.status and leader.status.phase == "Failed":  # evicted, no exit code
            return GroupState(failure=f"the leader pod {leader.metadata.name} failed ({leader.status.reason or 'no reason given'})")
        for index in range(1, size):
            pod = by_index.get(index)
            if pod is None:
                continue
            code = _exit_code(pod)
            if code is not None or (pod.status and pod.status.phase == "Failed"):
                return GroupState(failure=f"follower {index} ({pod.metadata.name}) exited with code {code}",
                                  usage=code == exit_codes.USAGE, pod=pod.metadata.name, restarted=_restarted(pod))
        for index, pod in by_index.items():
            self._uids.setdefault(str(index), pod.metadata.uid)
        running = len(by_index) == size and all(p.status and p.status.phase == "Running" for p in by_index.values())
        return GroupState(running=running)

    def _log_tail(self, state: GroupState) -> str:
        """The last lines of the deciding pod's worker, into the task log; its error lines
        (or last lines), bounded, for a failure's message. Best effort: a log that cannot be
        read never changes the shard's outcome."""
        if state.pod is None:
            return ""
        try:
            # Raw bytes (the client's own decoding of a text/plain answer is a bytes repr).
            answer = self.hook().core_v1_client.read_namespaced_pod_log(
                state.pod, self.namespace, container=group_spec.CONTAINER, tail_lines=LOG_TAIL_LINES,
                previous=state.restarted, _preload_content=False)
            text = answer.data.decode("utf-8", errors="replace")
        except Exception as exc:  # noqa: BLE001 - see the docstring
            self.log.warning("could not read the log of %s: %s", state.pod, exc)
            return ""
        lines = [line.strip() for line in text.splitlines() if line.strip()]
        for line in lines:
            self.log.info("[%s] %s", state.pod, line)
        return error_tail(lines)

    # -- deletion ---------------------------------------------------------------------

    def delete_group(self, name: str | None = None) -> None:
        """Delete the set (and by cascade its StatefulSets and pods); gone already is fine."""
        name = name or self.set_name
        if name is None:
            return
        try:
            self._objects().delete_namespaced_custom_object(group_spec.GROUP, group_spec.VERSION, self.namespace,
                                                            group_spec.PLURAL, name, propagation_policy="Foreground")
        except ApiException as exc:
            if exc.status != 404:
                raise

    def _delete_stale(self, task: ShardTask) -> None:
        """Delete the sets of earlier attempts of this shard and wait (bounded) until they are gone."""
        def stale() -> list[str]:
            found = self._objects().list_namespaced_custom_object(
                group_spec.GROUP, group_spec.VERSION, self.namespace, group_spec.PLURAL,
                label_selector=group_spec.shard_selector(task))
            return [item["metadata"]["name"] for item in found.get("items", [])]

        try:
            names = stale()
        except ApiException as exc:
            if exc.status == 404:  # no LeaderWorkerSet API: the create says so
                return
            raise
        if not names:
            return
        self.log.warning("shard %s: deleting LeaderWorkerSets of an earlier attempt: %s", task.shard, ", ".join(names))
        for name in names:
            self.delete_group(name)
        deadline = time.monotonic() + STALE_WAIT_S
        while stale() and time.monotonic() < deadline:
            time.sleep(self.poll_interval)


def _restarted(pod: Any) -> bool:
    statuses = (pod.status.container_statuses if pod.status else None) or []
    return any(status.name == group_spec.CONTAINER and (status.restart_count or 0) > 0 for status in statuses)


def _api_message(exc: ApiException) -> str:
    import json

    try:
        return str(json.loads(exc.body or "{}").get("message") or exc.reason)
    except ValueError:
        return str(exc.reason)


def _exit_code(pod: Any) -> int | None:
    """The exit code of the pod's worker container if it has exited: its current state, or
    the last one once the kubelet restarted it (StatefulSet pods restart on every exit)."""
    for status in (pod.status.container_statuses if pod.status else None) or []:
        if status.name != group_spec.CONTAINER:
            continue
        for state in (status.state, status.last_state):
            if state is not None and state.terminated is not None:
                return state.terminated.exit_code
    return None
