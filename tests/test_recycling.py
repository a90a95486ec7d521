"""Recycling: `--max-jobs-per-child` and `--max-memory-per-child` replace a worker's child
by a fresh process once it has finished its jobs: none is lost, handed back or counted."""

from __future__ import annotations

import collections

import psutil

from tests.conftest import wait_for


def test_children_are_replaced_after_max_jobs_with_nothing_lost(app, stack):
    jobs = app.enqueue_many([{"task": "tests.apps.child_pid"} for _ in range(12)])
    w = stack.worker("--max-jobs-per-child", "3", concurrency=2)
    pids = collections.Counter(j.wait(60) for j in jobs)
    assert max(pids.values()) <= 3 and len(pids) >= 4, pids
    assert all(j.refresh().data["attempts"] == "1" for j in jobs)  # nothing handed back or rerun
    # Each that ran 3 is replaced: once it has exited (a child that just answered its third
    # job may still be alive for a moment, beside the other one), two children that ran fewer.
    wait_for(lambda: (c := stack.children_of(w)) and len(c) == 2 and all(pids[pid] < 3 for pid in c),
             what="two children again, each with fewer than 3 jobs run")


def exited(pid: int) -> bool:
    """Gone, or a zombie (it may exit between the two looks: then gone)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_a_child_over_max_memory_is_replaced_after_its_job(app, stack):
    w = stack.worker("--max-memory-per-child", "120", concurrency=1)
    first = app.tasks["tests.apps.child_pid"].delay(150).wait(60)  # leaves 150 MB in its child
    wait_for(lambda: exited(first), what="the bloated child to exit")
    second = app.tasks["tests.apps.child_pid"].delay().wait(60)
    assert second != first
    assert app.tasks["tests.apps.child_pid"].delay().wait(60) == second  # a lean child stays
    assert w.poll() is None
