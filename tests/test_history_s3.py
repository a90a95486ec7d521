"""The job-history archive on object storage: the archiver, compaction (killed at any step,
the steps of an S3 "rename" included) and analyze's listing on a local S3-compatible server
(moto's, a real HTTP server in its own process), and analyze's one-line refusal when Spark
has no S3A connector."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import urllib.request

import pyarrow.parquet as pq
import pytest

from taskrunner.ops.analyze import plan, s3a_conf, spark_location
from taskrunner.ops.compact import Compactor
from taskrunner.ops.history import Archiver, open_dir
from tests.conftest import wait_for
from tests.test_compact import Dies, day, put

BUCKET = "taskrunner-history"


def _moto_installed() -> bool:
    try:
        import moto.server  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.fixture(scope="module")
def s3_server(tmp_path_factory):
    """moto's S3 server on a free local port, for the module; stopped at its end."""
    if not _moto_installed():
        if os.environ.get("CI"):  # a declared test dependency (setup.cfg, test extra): missing is a failure
            pytest.fail("moto[server] is not installed (the test extra: pip install -e '.[test]')")
        pytest.skip("moto[server] is not installed (pip install 'moto[server]'): no local S3 server")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = open(tmp_path_factory.mktemp("moto") / "moto.log", "w")
    p = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                         stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"

    def up() -> bool:
        assert p.poll() is None, f"moto's server exited {p.returncode}"
        try:
            return urllib.request.urlopen(url + "/moto-api/", timeout=1).status == 200
        except OSError:
            return False

    try:
        wait_for(up, what="moto's S3 server")
        yield url
    finally:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()
        log.close()


@pytest.fixture
def s3(s3_server, monkeypatch, request):
    """An empty archive URI `s3://<bucket>/<test>` on the local server, which pyarrow (here
    and in the processes the test starts) finds through the standard AWS variables."""
    import pyarrow.fs as pafs

    for k, v in {"AWS_ENDPOINT_URL": s3_server, "AWS_ACCESS_KEY_ID": "testing",
                 "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}.items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("AWS_ENDPOINT_URL_S3", raising=False)
    fs, _ = pafs.FileSystem.from_uri(f"s3://{BUCKET}?allow_bucket_creation=true")  # the URI reads the variables
    fs.create_dir(BUCKET)
    return f"s3://{BUCKET}/{request.node.name.replace('[', '-').rstrip(']')}"


def read(uri: str) -> list[dict]:
    """What a reader sees: the files analyze would read, every row."""
    fs, root = open_dir(uri)
    files, _ = plan(uri, 0)
    return sorted((row for f in files for row in pq.read_table(root + f, filesystem=fs).to_pylist()),
                  key=lambda r: r["stream_id"])


def objects(uri: str, when: str = "") -> list[str]:
    """Every object's name under the archive (a date's, if given), leftovers included."""
    import pyarrow.fs as pafs

    fs, root = open_dir(uri)
    infos = fs.get_file_info(pafs.FileSelector(root + (f"/date={when}" if when else ""), recursive=True))
    return sorted(i.base_name for i in infos if i.type == pafs.FileType.File)


def on_store(uri: str) -> list[str]:
    """Every record of every Parquet object there is, leftovers included."""
    import pyarrow.fs as pafs

    fs, root = open_dir(uri)
    infos = fs.get_file_info(pafs.FileSelector(root, recursive=True))
    return sorted(r for i in infos if i.type == pafs.FileType.File and i.base_name.endswith(".parquet")
                  for r in pq.read_table(i.path, filesystem=fs, columns=["stream_id"]).column("stream_id").to_pylist())


@pytest.fixture
def archive(app, s3):
    """1,200 records of one queue over today and yesterday, in batches of 120: 10 objects a
    (date, queue) partition, written by the real archiver to S3."""
    put(app, 1200, [0, 1], queue="q1")
    assert Archiver(app, s3, batch=120).archive() == 1200
    return s3


def test_archive_compaction_and_listing_on_s3(app, s3, archive, stack):
    before = read(archive)
    assert len(before) == 1200 and len({r["stream_id"] for r in before}) == 1200
    assert len(objects(archive)) == 20 and not [n for n in objects(archive) if n.startswith(".")]
    _, read_stats = plan(archive, 0)
    assert read_stats["files"] == 20 and read_stats["partitions"] == 2 and read_stats["bytes"] > 0
    # by the CLI, in another process: the same variables find the same server
    r = stack.cli("history", "compact", "--history-dir", archive, "--json", check=True)
    assert '"merged": 10' in r.stdout and '"written": 1' in r.stdout  # yesterday's; not today's
    assert read(archive) == before and on_store(archive) == [r["stream_id"] for r in before]
    assert len(objects(archive, day(1))) == 1 and len(objects(archive, day(0))) == 10
    assert not [n for n in objects(archive) if n.startswith(".")]


class DiesAfterCopy(Compactor):
    """Dies inside its first commit the way an S3 move can: the object copied to its final
    name (S3 has no rename: pyarrow's move is a copy, then a delete), the temporary not
    deleted yet."""

    def _commit(self, tmp, final):
        self.fs.copy_file(tmp, final)
        raise KeyboardInterrupt("killed between the copy and the delete of an S3 move")


@pytest.mark.parametrize("at", ["written", "copied", "renamed", "deleting"])
def test_a_compaction_killed_at_any_step_on_s3_leaves_every_record_once(app, archive, at):
    before = read(archive)
    with pytest.raises(KeyboardInterrupt):
        (DiesAfterCopy(app, archive) if at == "copied" else Dies(app, archive, at=at)).run([day(1)])
    assert read(archive) == before  # a reader meanwhile: each record once
    names = objects(archive, day(1))
    assert any(n.startswith(".compact-") for n in names) == (at in ("written", "copied")), names
    if at != "written":  # the merged object is in place beside (some of) its inputs, which readers ignore
        assert len(on_store(archive)) > 1200
    Compactor(app, archive).run([day(1)])  # the next one finishes it
    assert read(archive) == before and on_store(archive) == [r["stream_id"] for r in before]
    assert len(objects(archive, day(1))) == 1


def test_a_history_dir_maps_to_spark():
    assert spark_location("s3://b/p/?endpoint_override=localhost:9000&scheme=http") == "s3a://b/p"
    assert spark_location("s3://b") == "s3a://b" and spark_location("gs://b/p") == "gs://b/p"
    assert spark_location("var/history") == os.path.abspath("var/history")
    env = {"AWS_ENDPOINT_URL": "http://127.0.0.1:9000", "AWS_DEFAULT_REGION": "eu-west-1",
           "AWS_ACCESS_KEY_ID": "k", "AWS_SECRET_ACCESS_KEY": "secret"}
    assert s3a_conf("s3://b/p", env) == {
        "spark.hadoop.fs.s3a.endpoint": "http://127.0.0.1:9000", "spark.hadoop.fs.s3a.path.style.access": "true",
        "spark.hadoop.fs.s3a.connection.ssl.enabled": "false", "spark.hadoop.fs.s3a.endpoint.region": "eu-west-1"}
    assert s3a_conf("s3://b/p?endpoint_override=minio:9000&region=r1", {"AWS_ENDPOINT_URL_S3": "http://x"}) == {
        "spark.hadoop.fs.s3a.endpoint": "https://minio:9000", "spark.hadoop.fs.s3a.path.style.access": "true",
        "spark.hadoop.fs.s3a.connection.ssl.enabled": "true", "spark.hadoop.fs.s3a.endpoint.region": "r1"}
    assert s3a_conf("s3://b/p", {}) == {} and s3a_conf("/var/history", env) == {}


def test_analyze_of_an_s3_archive_without_the_s3a_jars_is_one_line(app, archive, stack):
    """PySpark ships no hadoop-aws: analyze says so, in one line, before reading (exit 1)."""
    pytest.importorskip("pyspark")
    if not shutil.which("java") and not os.environ.get("CI"):
        pytest.skip("no Java (scripts/ensure-java.sh)")
    import pyspark

    jars = os.listdir(os.path.join(os.path.dirname(pyspark.__file__), "jars"))
    if any(j.startswith("hadoop-aws") for j in jars):
        pytest.skip("this PySpark has hadoop-aws: S3A is there")
    r = stack.cli("analyze", "--history-dir", archive, timeout=180)
    errors = [line for line in r.stderr.splitlines() if line.startswith("Error")]  # (the JVM may warn)
    assert r.returncode == 1 and len(errors) == 1 and "\tat " not in r.stderr, r.stderr
    assert errors[0].startswith(f"Error: Spark cannot read {spark_location(archive)}: its Hadoop ")
    assert "hadoop-aws" in errors[0] and "Traceback" not in r.stderr
