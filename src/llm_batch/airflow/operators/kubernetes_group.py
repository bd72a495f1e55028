"""ShardGroupOperator: a shard whose worker spans several nodes, as a LeaderWorkerSet (``group_spec``)
created, watched and deleted per attempt (docs/orchestration.md, "Multi-node workers"). A
triggerer restart starts the watch afresh: a pod replaced across it goes unnoticed."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from airflow.providers.cncf.kubernetes.hooks.kubernetes import KubernetesHook
from airflow.sdk import BaseOperator
from airflow.triggers.base import BaseTrigger, TriggerEvent
from kubernetes.client.exceptions import ApiException

from llm_batch.airflow.operators.shard import ShardTaskMixin, error_tail, exit_code_of, shard_stop_of, watch_shard
from llm_batch.airflow.specs import group_spec
from llm_batch.core import exit_codes
from llm_batch.core.config import Settings
from llm_batch.pipeline.shard_task import ShardOutcome, ShardTask

POLL_SECONDS = 5.0
STARTUP_TIMEOUT_S = 900  # image pulls of a vLLM image are slow (as the single pod's)
STALE_WAIT_S = 120.0  # how long an old attempt's set may take to go
LOG_TAIL_LINES = 20  # of the pod whose exit decided, into the task log (and a failure's message)
# The pod operator's overrides that also apply here; the others (deferrable, ...) do not.
HOOK_ARGS = ("kubernetes_conn_id", "config_file", "in_cluster", "cluster_context")

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GroupState:
    """What one read of the group found."""

    leader_exit: int | None = None  # the leader's container has exited with this code
    failure: str | None = None  # the group broke (and why)
    usage: bool = False  # ... because a follower refused its arguments
    running: bool = False  # every pod of the group is running
    pod: str | None = None  # the pod whose exit decided, and whether its container has
    restarted: bool = False  # restarted since (its log is then the previous container's)


class GroupWatch:
    """One running group's supervision, a round at a time (blocking: the task or a trigger's thread
    runs it). ``round`` returns None while the group works on, else the JSON verdict:
    ``{"state": GroupState fields}`` or ``{"stopped": cause}``."""

    def __init__(self, hook: Any, namespace: str, name: str, size: int, shard_stop: dict[str, Any],
                 startup_timeout_seconds: float, created_at: float) -> None:
        self.hook, self.namespace, self.name, self.size = hook, namespace, name, size
        self.shard_stop = shard_stop
        self.startup_timeout_seconds = startup_timeout_seconds
        self.created_at = created_at  # Unix time: the trigger is built after the task's create
        self._uids: dict[int, str] = {}  # worker index -> the uid of its pod when first seen
        self._ever_running = False
        self._stop_seen: tuple[str, float] | None = None

    def round(self) -> dict[str, Any] | None:
        cause = watch_shard(self.shard_stop)
        state = self.read()
        if state.leader_exit is not None or state.failure is not None:
            return {"state": dataclasses.asdict(state)}
        self._ever_running = self._ever_running or state.running
        if not self._ever_running and time.time() - self.created_at > self.startup_timeout_seconds:
            return {"state": dataclasses.asdict(GroupState(failure=(
                f"the group of {self.size} pods was not running {self.startup_timeout_seconds:.0f}s after it was created")))}
        if self._stop_seen is None:
            if cause is not None:
                log.info("group %s: %s; waiting up to %ss for the leader", self.name, cause, self.shard_stop["grace_seconds"])
                self._stop_seen = (cause, time.monotonic())
        elif time.monotonic() - self._stop_seen[1] > self.shard_stop["grace_seconds"]:
            log.warning("group %s: leader did not stop %ss after %s: deleting the group", self.name,
                        self.shard_stop["grace_seconds"], self._stop_seen[0])
            return {"stopped": self._stop_seen[0]}
        return None

    def read(self) -> GroupState:
        """One read of the set and its pods."""
        try:
            self.hook.custom_object_client.get_namespaced_custom_object(
                group_spec.GROUP, group_spec.VERSION, self.namespace, group_spec.PLURAL, self.name)
        except ApiException as exc:
            if exc.status == 404:
                return GroupState(failure=f"LeaderWorkerSet {self.name} was deleted while the shard ran")
            raise
        pods = self.hook.core_v1_client.list_namespaced_pod(
            self.namespace, label_selector=group_spec.group_selector(self.name)).items
        by_index = {int((pod.metadata.labels or {}).get(group_spec.WORKER_INDEX_LABEL, -1)): pod for pod in pods}
        leader = by_index.get(0)
        if leader is not None and (code := exit_code_of(leader, group_spec.CONTAINER)) is not None:
            return GroupState(leader_exit=code, pod=leader.metadata.name, restarted=_restarted(leader))
        for index, uid in self._uids.items():
            pod = by_index.get(index)
            if pod is None or pod.metadata.uid != uid:
                return GroupState(failure=f"pod {index} of the group was deleted or replaced")
        if leader is not None and leader.status and leader.status.phase == "Failed":  # evicted, no exit code
            return GroupState(failure=f"the leader pod {leader.metadata.name} failed ({leader.status.reason or 'no reason given'})")
        for index in range(1, self.size):
            pod = by_index.get(index)
            if pod is None:
                continue
            code = exit_code_of(pod, group_spec.CONTAINER)
            if code is not None or (pod.status and pod.status.phase == "Failed"):
                return GroupState(failure=f"follower {index} ({pod.metadata.name}) exited with code {code}",
                                  usage=code == exit_codes.USAGE, pod=pod.metadata.name, restarted=_restarted(pod))
        for index, pod in by_index.items():
            self._uids.setdefault(index, pod.metadata.uid)
        running = len(by_index) == self.size and all(p.status and p.status.phase == "Running" for p in by_index.values())
        return GroupState(running=running)


def delete_group(hook: Any, namespace: str, name: str) -> None:
    """Delete the set (and by cascade its StatefulSets and pods); gone already is fine."""
    try:
        hook.custom_object_client.delete_namespaced_custom_object(
            group_spec.GROUP, group_spec.VERSION, namespace, group_spec.PLURAL, name, propagation_policy="Foreground")
    except ApiException as exc:
        if exc.status != 404:
            raise


class ShardGroupOperator(ShardTaskMixin, BaseOperator):
    """Run one shard (``shard_task``, with ``nodes_per_worker > 1``) as a LeaderWorkerSet.

    ``kubernetes_conn_id`` / ``config_file`` / ``in_cluster`` / ``cluster_context``: the
    cluster (KubernetesHook's arguments; default: the settings' connection).
    ``deferrable``: wait in the triggerer (default) or in the task. ``poll_interval``: seconds
    between watch rounds. ``startup_timeout_seconds``: how long until every pod must run.
    Returns the outcome dict; a failed attempt raises for a retry, a usage error fails without.
    """

    template_fields = ("shard_task",)
    ui_color = "#e8eef8"

    def __init__(self, *, shard_task: dict[str, Any], poll_interval: float = POLL_SECONDS,
                 startup_timeout_seconds: float = STARTUP_TIMEOUT_S, deferrable: bool = True,
                 settings: Settings | None = None, **kwargs: Any) -> None:
        self.hook_args = {name: kwargs.pop(name) for name in HOOK_ARGS if name in kwargs}
        kwargs.pop("namespace", None)  # a pod-operator override with no meaning here
        super().__init__(**kwargs)
        self.use_settings(settings)
        self.shard_task = shard_task
        self.poll_interval = poll_interval
        self.startup_timeout_seconds = startup_timeout_seconds
        self.deferrable = deferrable
        self.set_name: str | None = None
        self._killed = threading.Event()

    @property
    def namespace(self) -> str:
        return self.llm_settings.k8s_namespace

    @property
    def hook_kwargs(self) -> dict[str, Any]:
        """KubernetesHook's arguments: the overrides given, else the settings' connection."""
        args = {"conn_id": self.llm_settings.k8s_conn_id, **self.hook_args}
        if "kubernetes_conn_id" in args:
            args["conn_id"] = args.pop("kubernetes_conn_id")
        return args

    @cached_property
    def hook(self) -> Any:
        return KubernetesHook(**self.hook_kwargs)

    def execute(self, context: Any) -> dict[str, Any]:
        if (ended := self.ended_before_start(context)) is not None:
            return ended
        task = self.shard
        self._delete_stale(task)
        name = group_spec.set_name(task)
        body = group_spec.leader_worker_set(task, self.llm_settings, name)
        self.log.info("shard %s: creating LeaderWorkerSet %s (%s nodes x %s GPUs)", task.shard, name,
                      task.nodes_per_worker, task.gpus)
        self.set_name = name  # before the call: a kill while it is on its way deletes it too
        try:
            self.hook.custom_object_client.create_namespaced_custom_object(
                group_spec.GROUP, group_spec.VERSION, self.namespace, group_spec.PLURAL, body)
        except ApiException as exc:
            if exc.status not in (404, 422):
                raise  # the API server failing: worth a retry
            why = ("the cluster serves no LeaderWorkerSet API (leaderworkerset.x-k8s.io/v1): install the LWS "
                   "controller (https://github.com/kubernetes-sigs/lws) to run nodes_per_worker > 1"
                   if exc.status == 404 else f"the cluster refused the LeaderWorkerSet: {_api_message(exc)}")
            return self.finish(self._failed(why, usage=True), context)
        watch = {"namespace": self.namespace, "name": name, "size": task.nodes_per_worker,
                 "shard_stop": shard_stop_of(task, self.llm_settings),
                 "startup_timeout_seconds": self.startup_timeout_seconds, "created_at": time.time()}
        if self.deferrable:  # raises TaskDeferred: Airflow resumes in trigger_reentry
            self.defer(trigger=ShardGroupTrigger(hook_args=self.hook_kwargs, watch=watch, poll_interval=self.poll_interval),
                       method_name="trigger_reentry")
        return self._end(lambda: self._supervise(GroupWatch(self.hook, **watch)), context)

    def trigger_reentry(self, context: Any, event: dict[str, Any]) -> dict[str, Any]:
        self.set_name = event["name"]
        return self._end(lambda: event, context)

    def _end(self, verdict: Callable[[], dict[str, Any]], context: Any) -> dict[str, Any]:
        """The outcome of the watch's verdict, the group deleted however it ends."""
        try:
            outcome = self._outcome_of(verdict())
        finally:
            self.delete_group()
        return self.finish(outcome, context)

    def on_kill(self) -> None:
        self._killed.set()
        if self.set_name is not None:
            self.log.info("task killed: deleting LeaderWorkerSet %s", self.set_name)
            self.delete_group()

    def _supervise(self, watch: GroupWatch) -> dict[str, Any]:
        while True:
            if self._killed.is_set():
                return {"killed": True}
            if (verdict := watch.round()) is not None:
                return verdict
            self._killed.wait(self.poll_interval)

    def _outcome_of(self, verdict: dict[str, Any]) -> ShardOutcome:
        if verdict.get("killed"):
            return self._failed("the task was killed", exit_code=-9)
        if (cause := verdict.get("stopped")) is not None:
            return self.outcome(None, cause)
        state = GroupState(**verdict["state"])
        tail = self._log_tail(state)
        if state.leader_exit is not None:
            outcome = self.outcome(state.leader_exit, None)
        else:
            outcome = self._failed(state.failure or "", usage=state.usage)
        if outcome.state in ("failed", "usage") and tail:
            outcome = outcome.model_copy(update={"message": f"{outcome.message}: {tail}"})
        return outcome

    def _failed(self, why: str, *, usage: bool = False, exit_code: int = exit_codes.FAILED) -> ShardOutcome:
        return ShardOutcome(shard=self.shard.shard, exit_code=exit_codes.USAGE if usage else exit_code,
                            state="usage" if usage else "failed",
                            message=f"multi-node worker failed: {why}" + ("" if usage else "; a retry makes a new group and resumes"))

    def _log_tail(self, state: GroupState) -> str:
        """The deciding pod's last lines into the task log; their error tail for a failure's
        message. Best effort: an unreadable log never changes the outcome."""
        if state.pod is None:
            return ""
        try:
            # Raw bytes (the client's own decoding of a text/plain answer is a bytes repr).
            answer = self.hook.core_v1_client.read_namespaced_pod_log(
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

    def delete_group(self, name: str | None = None) -> None:
        name = name or self.set_name
        if name is not None:
            delete_group(self.hook, self.namespace, name)

    def _delete_stale(self, task: ShardTask) -> None:
        """Delete earlier attempts' sets of this shard (two groups must never share a shard) and
        wait, bounded, until they are gone."""
        def stale() -> list[str]:
            found = self.hook.custom_object_client.list_namespaced_custom_object(
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


class ShardGroupTrigger(BaseTrigger):
    """Wait in the triggerer for a multi-node shard's group: GroupWatch's rounds, each in a thread,
    until its verdict (the event, with the set's ``name``). Its ``on_kill`` deletes the group.

    :param hook_args: KubernetesHook's arguments (the operator's ``hook_kwargs``).
    :param watch: GroupWatch's arguments other than the hook (JSON).
    :param poll_interval: seconds between rounds.
    """

    def __init__(self, *, hook_args: dict[str, Any], watch: dict[str, Any], poll_interval: float = POLL_SECONDS) -> None:
        super().__init__()
        self.hook_args = hook_args
        self.watch = watch
        self.poll_interval = poll_interval

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return (f"{__name__}.ShardGroupTrigger",
                {"hook_args": self.hook_args, "watch": self.watch, "poll_interval": self.poll_interval})

    async def run(self) -> AsyncIterator[TriggerEvent]:
        watch = await asyncio.to_thread(lambda: GroupWatch(KubernetesHook(**self.hook_args), **self.watch))
        while (verdict := await asyncio.to_thread(watch.round)) is None:
            await asyncio.sleep(self.poll_interval)
        yield TriggerEvent({**verdict, "name": self.watch["name"]})

    async def on_kill(self) -> None:
        self.log.info("deferred task killed: deleting LeaderWorkerSet %s", self.watch["name"])
        await asyncio.to_thread(lambda: delete_group(KubernetesHook(**self.hook_args), self.watch["namespace"],
                                                     self.watch["name"]))


def _restarted(pod: Any) -> bool:
    statuses = (pod.status.container_statuses if pod.status else None) or []
    return any(status.name == group_spec.CONTAINER and (status.restart_count or 0) > 0 for status in statuses)


def _api_message(exc: ApiException) -> str:
    try:
        return str(json.loads(exc.body or "{}").get("message") or exc.reason)
    except ValueError:
        return str(exc.reason)
