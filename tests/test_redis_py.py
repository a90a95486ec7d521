"""The redis-py range of setup.cfg. CI runs the whole suite with its lowest and its newest
version (.ci/debian-root.sh, `make test`); these tests say which one ran, that the fast path
(links.Direct and Channel, which use redis-py's connections' sockets themselves) is
taken on it, and that where redis-py or hiredis differ from what it needs, everything takes
redis-py's public path instead."""

from __future__ import annotations

import configparser
import re
import subprocess
import sys
from importlib.metadata import version

from packaging.requirements import Requirement

from taskrunner.protocol import links
from tests import apps
from tests.conftest import ROOT


def test_this_redis_py_is_in_the_range_and_takes_the_fast_path(app):
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    [req] = [Requirement(r) for r in cfg["options"]["install_requires"].split("\n") if re.match(r"redis\b", r)]
    assert req.specifier.contains(version("redis")), (version("redis"), str(req.specifier))
    print(f"redis-py {version('redis')}, hiredis {version('hiredis')}, in {req.specifier}")
    assert apps.add.delay(1, 2).id and app._direct is not None  # redis-py 5.0 has no pool.cache: not a reason
    assert links.FAST_PATH
    assert links.Channel.of(app.redis) is not None


def test_where_the_internals_differ_jobs_take_redis_pys_public_path(app, stack, tmp_path):
    """Here a redis-py whose parsers are not where 5.0 to 8.x keep them (redis._parsers.base;
    4.x had them in redis.connection): the producer and the worker work as before, through
    redis-py's own calls."""
    hide = "import sys\n\nimport redis\n\nsys.modules['redis._parsers.base'] = None\n"  # after redis-py took its own
    (tmp_path / "sitecustomize.py").write_text(hide)
    env = {"PYTHONPATH": f"{tmp_path}:{ROOT}"}
    stack.worker(env=env)
    code = ("from taskrunner.protocol import links\nfrom tests import apps\n"
            "assert not links.FAST_PATH\n"
            "job = apps.add.delay(2, 3)\n"
            "assert apps.app._direct is None and links.Channel.of(apps.app.redis) is None\n"
            "print(job.wait(30))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env={**stack.env, **env}, capture_output=True,
                         text=True, timeout=60)
    assert (out.returncode, out.stdout.strip()) == (0, "5"), out.stderr
