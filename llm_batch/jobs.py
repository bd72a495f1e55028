"""The canonical job: one state machine, and each dialect's words for its states."""

from __future__ import annotations

from enum import StrEnum


class JobStatus(StrEnum):
    QUEUED = "QUEUED"
    VALIDATING = "VALIDATING"
    RUNNING = "RUNNING"
    FINALIZING = "FINALIZING"
    CANCELLING = "CANCELLING"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"
    TIMEOUT_EXCEEDED = "TIMEOUT_EXCEEDED"
    CANCELLED = "CANCELLED"

    @property
    def terminal(self) -> bool:
        return self in TERMINAL_STATUSES


TERMINAL_STATUSES = frozenset(
    {JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.TIMEOUT_EXCEEDED, JobStatus.CANCELLED}
)

# Allowed moves. CANCELLING may be entered from any live state; every live state may end.
_LIVE = (JobStatus.QUEUED, JobStatus.VALIDATING, JobStatus.RUNNING, JobStatus.FINALIZING)
TRANSITIONS: dict[JobStatus, frozenset[JobStatus]] = {
    JobStatus.QUEUED: frozenset({JobStatus.VALIDATING, JobStatus.CANCELLING} | TERMINAL_STATUSES),
    JobStatus.VALIDATING: frozenset({JobStatus.RUNNING, JobStatus.CANCELLING} | TERMINAL_STATUSES),
    JobStatus.RUNNING: frozenset({JobStatus.FINALIZING, JobStatus.CANCELLING} | TERMINAL_STATUSES),
    JobStatus.FINALIZING: frozenset({JobStatus.CANCELLING} | TERMINAL_STATUSES),
    JobStatus.CANCELLING: frozenset({JobStatus.FINALIZING} | TERMINAL_STATUSES),
    **{s: frozenset() for s in TERMINAL_STATUSES},
}


class InvalidTransition(ValueError):
    pass


def check_transition(current: JobStatus, new: JobStatus) -> None:
    if new != current and new not in TRANSITIONS[current]:
        raise InvalidTransition(f"job status cannot move from {current} to {new}")


MISTRAL_STATUS = {
    JobStatus.QUEUED: "QUEUED",
    JobStatus.VALIDATING: "RUNNING",
    JobStatus.RUNNING: "RUNNING",
    JobStatus.FINALIZING: "RUNNING",
    JobStatus.CANCELLING: "CANCELLATION_REQUESTED",
    JobStatus.SUCCEEDED: "SUCCESS",
    JobStatus.FAILED: "FAILED",
    JobStatus.TIMEOUT_EXCEEDED: "TIMEOUT_EXCEEDED",
    JobStatus.CANCELLED: "CANCELLED",
}

SCALE_STATUS = {
    JobStatus.QUEUED: "queued",
    JobStatus.VALIDATING: "running",
    JobStatus.RUNNING: "running",
    JobStatus.FINALIZING: "running",
    JobStatus.CANCELLING: "running",
    JobStatus.SUCCEEDED: "completed",
    JobStatus.FAILED: "failed",
    # Scale has no timeout word: a job stopped at its deadline did not complete.
    JobStatus.TIMEOUT_EXCEEDED: "failed",
    JobStatus.CANCELLED: "cancelled",
}

OPENAI_STATUS = {
    JobStatus.QUEUED: "validating",
    JobStatus.VALIDATING: "validating",
    JobStatus.RUNNING: "in_progress",
    JobStatus.FINALIZING: "finalizing",
    JobStatus.CANCELLING: "cancelling",
    JobStatus.SUCCEEDED: "completed",
    JobStatus.FAILED: "failed",
    JobStatus.TIMEOUT_EXCEEDED: "expired",
    JobStatus.CANCELLED: "cancelled",
}
