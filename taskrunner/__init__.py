"""taskrunner: a reliable task runner on Redis."""

from taskrunner.client.app import JobSpec, Schedule, Task, TaskRunner
from taskrunner.client.canvas import Chain, Chord, Group, GroupJob, Signature, chain, chord, group
from taskrunner.client.job import Job
from taskrunner.errors import (
           BadArguments,
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
from taskrunner.worker.context import JobContext, current_job

__all__ = ["TaskRunner", "Task", "Job", "current_job", "JobContext", "chain", "Chain", "Signature", "group", "Group",
           "GroupJob", "chord", "Chord",
           "JobSpec", "Schedule", "Retry", "Reject", "SoftTimeLimit", "TaskRunnerError", "JobFailed",
           "JobNotFound", "NotJSONError", "PayloadTooLarge", "InvalidName", "Timeout", "QueueFull", "QueueClosed",
           "QueueNotFound", "BadArguments"]
