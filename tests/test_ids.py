"""Job ids (codec.new_id): ULIDs that sort in the order one process made them, also within
a millisecond (listings break ties of equal times by id: test_designs' test_recover_and_inspect
failed when two enqueues fell in the same millisecond), and never the same in a forked child."""

from __future__ import annotations

import os

from taskrunner.protocol import codec
from taskrunner.protocol.codec import new_id


def test_ids_sort_in_the_order_they_were_made():
    ids = [new_id() for _ in range(5000)]  # thousands within each millisecond
    assert ids == sorted(ids) and len(set(ids)) == len(ids)


def test_a_forked_child_makes_other_ids_than_its_parent():
    new_id()
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: whether it starts afresh, and its ids, to the parent; then out at once
        os.write(w, " ".join([str(codec._last_id == 0)] + [new_id() for _ in range(100)]).encode())
        os._exit(0)
    os.close(w)
    mine = [new_id() for _ in range(100)]
    with os.fdopen(r) as f:
        afresh, *theirs = f.read().split()
    os.waitpid(pid, 0)
    assert afresh == "True"  # else, in the same millisecond, both would count up from the same id
    assert len(theirs) == 100 and not set(mine) & set(theirs)
