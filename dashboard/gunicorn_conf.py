"""gunicorn settings for the dashboard: `gunicorn -c python:dashboard.gunicorn_conf ...`."""

import os

from gunicorn.glogging import Logger

from dashboard.security import check_bind
from taskrunner import logs

control_socket_disable = True  # a second gunicorn would silently take over the first's socket
graceful_timeout = 25  # platforms send SIGKILL 30 s after SIGTERM
LOG_FORMAT = os.environ.get("TASKRUNNER_LOG_FORMAT", "text")
logs.formatter(LOG_FORMAT)  # a bad value stops gunicorn here, saying the choices


class TaskRunnerLogger(Logger):
    """gunicorn's own logger, in TASKRUNNER_LOG_FORMAT (json: its error and access lines
    as JSON objects too); the dashboard's records (taskrunner.dashboard) go to stderr in
    the same format, at gunicorn's --log-level. Set up again on each reload (HUP)."""

    def setup(self, cfg):  # noqa: ANN001, ANN201 - gunicorn's signature
        super().setup(cfg)
        if LOG_FORMAT == "json":
            for log in (self.error_log, self.access_log):
                for handler in log.handlers:
                    handler.setFormatter(logs.JsonFormatter())
        logs.configure(cfg.loglevel, LOG_FORMAT)


logger_class = TaskRunnerLogger


def on_starting(server):  # noqa: ANN001 - gunicorn's hook signature
    check_bind(list(server.cfg.bind), os.environ.get("TASKRUNNER_DASHBOARD_PASSWORD"))
