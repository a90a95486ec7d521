"""Finding the user's TaskRunner from `-A module` or `-A module:attribute`."""

from __future__ import annotations

import importlib
import os
import sys

from taskrunner.client.app import TaskRunner
from taskrunner.errors import AppNotFound


def load_app(spec: str | None, redis_url: str | None = None) -> TaskRunner:
    """Import the app (from the current directory too, like `python -m`); with no spec,
    a bare app: enough for every command but running tasks."""
    if not spec:
        app = TaskRunner("taskrunner")
    else:
        if os.getcwd() not in sys.path:
            sys.path.insert(0, os.getcwd())
        module_name, _, attr = spec.partition(":")
        try:
            module = importlib.import_module(module_name)
        except ImportError as e:
            raise AppNotFound(f"cannot import app module {module_name!r}: {e}") from None
        if attr:
            named = getattr(module, attr, None)
            if not isinstance(named, TaskRunner):
                raise AppNotFound(f"{spec}: {attr!r} is not a TaskRunner in {module_name}")
            app = named
        else:
            found = [v for v in vars(module).values() if isinstance(v, TaskRunner)]
            if len(found) != 1:
                raise AppNotFound(f"{module_name} has {len(found)} TaskRunner instances; name one as "
                                 f"{module_name}:attribute")
            app = found[0]
    if redis_url:
        app.configure(redis_url=redis_url)
    return app
