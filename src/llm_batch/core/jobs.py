"""The canonical job: one state machine (each dialect's words for its states live at the
API edge, in the plugin's models)."""

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

# Allowed moves: CANCELLING may be entered from any live state; every live state may end.
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


class JobRejected(Exception):
    """The job cannot run (bad input, unsupported resources): it is FAILED with this reason."""


class Refused(JobRejected):
    """A job refused at admission: a 4xx status, what is wrong, where (``param``: the caller's
    name of the field) and a stable ``code``."""

    def __init__(self, status_code: int, message: str, *, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers
