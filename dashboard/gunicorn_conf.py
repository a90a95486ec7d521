"""gunicorn settings for the dashboard: `gunicorn -c python:dashboard.gunicorn_conf ...`."""

import os

from dashboard.security import check_bind

control_socket_disable = True  # a second gunicorn would silently take over the first's socket
graceful_timeout = 25  # platforms send SIGKILL 30 s after SIGTERM


def on_starting(server):  # noqa: ANN001 - gunicorn's hook signature
    check_bind(list(server.cfg.bind), os.environ.get("TASKRUNNER_DASHBOARD_PASSWORD"))
