"""taskrunner: a reliable task runner on Redis."""

from .app import JobSpec, Schedule, Task, TaskRunner
from .context import JobContext, current_job
from .errors import (
    InvalidName,
    JobFailed,
    JobNotFound,
    NotJSONError,
    PayloadTooLarge,
    QueueClosed,
    QueueFull,
    QueueNotFound,
    Reject,
    Retry,
    SoftTimeLimit,
    TaskRunnerError,
    Timeout,
)
from .job import Job

__all__ = ["TaskRunner", "Task", "Job", "current_job", "JobContext",
           "JobSpec", "Schedule", "Retry", "Reject", "SoftTimeLimit", "TaskRunnerError", "JobFailed",
           "JobNotFound", "NotJSONError", "PayloadTooLarge", "InvalidName", "Timeout", "QueueFull", "QueueClosed",
           "QueueNotFound"]
