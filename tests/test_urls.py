"""Multi-host URLs (redis+cluster://, redis+sentinel://) parse the same on every Python build:
they are split by hand, not by urlsplit, whose checks of a netloc as one host differ between
builds (Debian's python3 3.11.2 refused the first URL below: "Invalid IPv6 URL"). A bad one
gets one line saying what is wrong, without its passwords (the cases are in
test_hostile.py's test_bad_sentinel_and_cluster_urls_say_what_is_expected)."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from taskrunner.cli import main
from taskrunner.connection import ClusterURL, SentinelURL


@pytest.mark.parametrize("url, nodes, user, password", [
    ("redis+cluster://:p%40ss@10.0.0.1,[::1]:7001/", (("10.0.0.1", 6379), ("::1", 7001)), None, "p@ss"),
    ("redis+cluster://[::1]:7001,[2001:db8::2]", (("::1", 7001), ("2001:db8::2", 6379)), None, None),
    # '@' and ':' may be written raw in a password; '/', '%' percent-encoded.
    ("redis+cluster://ops:a@b:c%2Fd%25e@h1,redis-2.internal:7002", (("h1", 6379), ("redis-2.internal", 7002)),
     "ops", "a@b:c/d%e"),
    # '[' and ']' in a password: urlsplit refuses them on every Python when a host is bracketed.
    ("redis+cluster://:p[ss]@[::1]:7001,h_2", (("::1", 7001), ("h_2", 6379)), None, "p[ss]"),
    ("redis+cluster://[fe80::1%25eth0]:7001", (("fe80::1%eth0", 7001),), None, None),
])
def test_cluster_urls(url, nodes, user, password):
    u = ClusterURL.parse(url)
    assert (u.nodes, u.username, u.password) == (nodes, user, password)


def test_sentinel_url_with_ipv6_hosts_and_encoded_parts():
    u = SentinelURL.parse("redis+sentinel://:p%2F%3F%23@[::1]:26380,10.0.0.1,[2001:db8::1]/svc%2Fa/3"
                          "?sentinel_password=s%40%26&socket_timeout=0.5")
    assert u.sentinels == (("::1", 26380), ("10.0.0.1", 26379), ("2001:db8::1", 26379))
    assert (u.service, u.db, u.password, u.options) == ("svc/a", 3, "p/?#", {"socket_timeout": 0.5})
    assert u.sentinel_options["password"] == "s@&"


def test_cli_shows_a_bad_url_in_one_line_without_the_password():
    result = CliRunner().invoke(main, ["queues"], env={"REDIS_URL": "redis+cluster://:secret/x@h1"})
    assert result.exit_code != 0 and "Traceback" not in result.output
    [line] = result.output.splitlines()
    assert "percent-encoded" in line and "secret" not in line
