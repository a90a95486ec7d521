"""Multi-host URLs (redis+cluster://, redis+sentinel://) parse the same on every Python build:
they are split by hand, not by urlsplit, whose checks of a netloc as one host differ between
builds (Debian's python3 3.11.2 refused the first URL below: "Invalid IPv6 URL"). A bad one
gets one line saying what is wrong, without its passwords (the cases are in
test_hostile.py's test_bad_sentinel_and_cluster_urls_say_what_is_expected)."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from taskrunner.cli import main
from taskrunner.protocol.connection import ClusterURL, SentinelURL


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


def test_rediss_with_a_self_signed_certificate(app, tmp_path):
    """Heroku Redis serves rediss:// with a self-signed certificate, in a REDIS_URL the
    platform sets: redis-py refuses it, and a one-click deploy never ran a job. Now the
    refusal is one line naming the way out, TASKRUNNER_REDIS_SSL_CERT_REQS=none, with
    which the CLI, a worker and the wait of a job all work over TLS."""
    import subprocess

    from tests.conftest import Stack
    from tests.topologies import DATA_NODE, Topology, free_port

    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=localhost",
                    "-keyout", str(key), "-out", str(cert)], check=True, capture_output=True)
    with Topology(tmp_path / "nodes") as topology:
        tls = free_port()
        topology.start(*DATA_NODE, "--tls-port", str(tls), "--tls-cert-file", str(cert), "--tls-key-file", str(key),
                       "--tls-ca-cert-file", str(cert), "--tls-auth-clients", "no")
        stack = Stack(app, f"rediss://127.0.0.1:{tls}/0")
        try:
            r = stack.cli("jobs")
            assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
            assert "certificate" in r.stderr and "TASKRUNNER_REDIS_SSL_CERT_REQS=none" in r.stderr, r.stderr
            stack.env["TASKRUNNER_REDIS_SSL_CERT_REQS"] = "bogus"
            r = stack.cli("jobs")
            assert r.returncode == 2 and "expected one of none, optional, required" in r.stderr, r.stderr
            stack.env["TASKRUNNER_REDIS_SSL_CERT_REQS"] = "none"
            stack.worker()
            job_id = stack.cli("enqueue", "tests.apps.add", "--args", "[2, 3]", check=True).stdout.strip()
            r = stack.cli("wait", job_id, "--timeout", "60", check=True)
            assert r.stdout.strip() == "5", r.stdout
        finally:
            stack.stop()
