"""The worker's scheduling policy (taskrunner/worker/policy.py): pure functions, tested with plain
data — no Redis, no processes, no clock."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from pytest import approx

from taskrunner.protocol.claims import Delivery
from taskrunner.worker import policy
from taskrunner.worker.policy import FLUSH_AFTER, HOLD, INF, PREFETCH_WINDOW

NOW = 1000.0


def job(max_duration: float = 30.0, began: float | None = None, stuck: bool = False) -> Delivery:
    return Delivery("q", "id", "1", "t", "[]", "{}", max_duration, began=began, stuck=stuck)


@dataclass
class Lane:
    jobs: deque = field(default_factory=deque)
    open: bool = True
    left: float = INF
    capacity: int = 1
    kill_at: float | None = None
    last_began: float | None = None


def lane(*jobs: Delivery, **kw) -> Lane:
    return Lane(deque(jobs), **kw)


def test_depth_is_one_until_a_job_ran_then_what_fills_the_window_up_to_prefetch():
    assert policy.depth(None, 100) == 1
    assert policy.depth(0.0001, 1) == 1
    assert policy.depth(PREFETCH_WINDOW / 10, 100) == 10
    assert policy.depth(PREFETCH_WINDOW / 1000, 50) == 50
    assert policy.depth(5.0, 100) == 1


def test_slots_are_interleaved_and_skip_long_jobs_and_stopping_children():
    idle, busy = lane(), lane(job(began=NOW - 0.001))
    long_job, stopping = lane(job(began=NOW - 2 * PREFETCH_WINDOW)), lane(open=False)
    got = policy.slots([idle, busy, long_job, stopping], 3, NOW)
    assert [s[0] for s in got] == [idle, busy, idle, busy, idle]
    assert got[0][1] == 0 and abs(got[1][1] - (30 - 0.001)) < 1e-9  # max duration ahead of the next job
    capped = Lane(left=2)  # replaced after 2 more jobs: never sent a third
    assert [s[0] for s in policy.slots([capped], 3, NOW)] == [capped, capped]


def test_a_child_that_runs_many_at_once_is_sent_enough_to_fill_its_free_slots_whatever_the_depth():
    """Its jobs begin at once, so prefetch depth (1 once jobs take 10 ms) does not limit
    it: one claim fills it. It used to be sent one job per claim (found by bench/io_bound.py:
    at 256-way, 2 children held 140 of their 256 slots, at 17 Redis commands per job)."""
    loop, other = lane(job(began=NOW), capacity=128), lane(capacity=4, left=2)
    got = [s[0] for s in policy.slots([loop, other], 1, NOW)]
    assert got.count(loop) == 127 and got.count(other) == 2
    assert got[:4] == [loop, other, loop, other]  # interleaved: a short claim is shared out


def test_a_child_that_runs_many_at_once_keeps_what_it_begins_in_the_prefetch_window_as_spare_jobs():
    assert policy.spare(None, 128, 128) == 0  # nothing ran yet
    assert policy.spare(0.200, 128, 128) == 64  # 128 slots x 100 ms / 200 ms
    assert policy.spare(0.020, 8, 128) == 40  # 8 slots x 100 ms / 20 ms
    assert policy.spare(0.001, 128, 100) == 100  # at most the prefetch
    assert policy.spare(0.020, 128, 1) == 0  # --prefetch 1: nothing sent ahead
    assert policy.spare(0.001, 1, 128) == 0  # a classic child: depth() says
    assert policy.spare(30.0, 128, 128) == 0  # long jobs: none


def spare_lane(running: int, waiting: int, capacity: int = 4, last_began: float | None = NOW, **kw) -> Lane:
    return lane(*[job(10.0, began=NOW - 1) for _ in range(running)], *[job(5.0) for _ in range(waiting)],
                capacity=capacity, last_began=last_began, **kw)


def test_spare_jobs_go_to_a_moving_child_with_their_latest_start_ahead_of_them():
    """Jobs beyond a loop child's free slots begin as slots free, without a round trip to
    Redis (found by bench/io_bound.py: a 20 ms job held its slot ~26 ms at 256-way, 79%
    of the ideal). Their holding entries count the work ahead of them: the most left of
    a running job's max duration, then the waiting jobs' one after the other."""
    full = spare_lane(4, 1)
    got = policy.slots([full], 1, NOW, spare=3)
    assert [c for c, _ in got] == [full, full]  # 4 slots + 3 spare, 5 held
    assert got[0][1] == approx(9.0 + 5.0)
    free = spare_lane(2, 0)
    got = policy.slots([free], 1, NOW, spare=3)
    assert len(got) == 5 and got[0][1] == 0  # its next job begins at once
    stalled = spare_lane(4, 0, last_began=NOW - 2 * PREFETCH_WINDOW)  # long jobs hold every slot
    assert policy.slots([stalled], 1, NOW, spare=3) == []
    fresh = spare_lane(2, 0, last_began=None)  # none begun yet: its free slots only
    assert [c for c, _ in policy.slots([fresh], 1, NOW, spare=3)] == [fresh] * 2


def test_a_moving_child_is_claimed_for_once_down_to_half_of_its_spare_jobs():
    assert policy.hungry(spare_lane(3, 0), 1, NOW)  # a free slot
    assert not policy.hungry(spare_lane(4, 0), 1, NOW)  # no spare jobs wanted
    assert policy.hungry(spare_lane(4, 2), 1, NOW, spare=4)
    assert not policy.hungry(spare_lane(4, 3), 1, NOW, spare=4)
    assert not policy.hungry(spare_lane(4, 2, last_began=NOW - 1), 1, NOW, spare=4)  # stalled


def test_a_worker_listens_for_new_jobs_while_a_child_has_room():
    busy, idle = lane(job(began=NOW)), lane()
    assert not policy.listening([busy])  # a classic child takes the next when it is done
    assert policy.listening([busy, idle])
    assert not policy.listening([lane(open=False)])  # retiring: its successor will listen
    loop = lane(job(began=NOW), capacity=3)
    assert policy.listening([loop])  # a free slot: a job enqueued now begins at once
    assert not policy.listening([lane(job(), job(), job(), capacity=3)])


def test_quiet_children_are_those_with_short_jobs_queued_beyond_half_depth():
    full, low = lane(job(), job(), job()), lane(job())
    assert policy.quiet([full, low], None, 4, False) == []  # nothing ran yet
    assert policy.quiet([full, low], 0.0001, 4, False) == [full]
    assert policy.quiet([full, low], 0.0001, 4, True) == []  # stopping: every answer at once
    assert policy.quiet([full], 1.0, 4, False) == []  # long jobs: wake for each answer


def test_a_child_is_retired_past_its_job_count_or_memory():
    assert policy.retire_reason(99, None, 100, None) is None
    assert policy.retire_reason(100, None, 100, None) == "it ran 100 jobs (--max-jobs-per-child 100)"
    assert policy.retire_reason(5, 300 * 2**20, None, 200) == "it uses 300 MB (--max-memory-per-child 200)"
    assert policy.retire_reason(5, 100 * 2**20, None, 200) is None
    assert policy.retire_reason(5, None, None, 200) is None  # not measured
    assert policy.retire_reason(10**6, 10**12, None, None) is None  # recycling off


def test_hand_back_when_the_running_job_ran_hold_or_its_max_duration_or_at_once_when_stopping():
    assert policy.hand_back_due(lane(job(began=NOW)), False) == INF  # nothing sent ahead
    assert policy.hand_back_due(lane(job(), job()), False) == INF  # the first has not begun
    assert policy.hand_back_due(lane(job(began=NOW), job()), False) == NOW + HOLD
    assert policy.hand_back_due(lane(job(0.2, began=NOW), job()), False) == NOW + 0.2
    assert policy.hand_back_due(lane(job(began=NOW), job()), True) == -INF
    # A child that runs several at once: its spare jobs, once it has begun none for HOLD.
    assert policy.hand_back_due(spare_lane(4, 1, last_began=NOW - 0.5), False) == NOW - 0.5 + HOLD
    assert policy.hand_back_due(spare_lane(3, 1, last_began=NOW - 0.5), False) == INF  # within its slots
    assert policy.hand_back_due(spare_lane(4, 1), True) == -INF


def due(lanes, **kw) -> float:
    args = dict(flights=0, urgent=False, outbox_since=None, notes_due=INF, can_claim=False, stopping=False)
    return policy.sync_due(NOW, lanes, 2, **{**args, **kw})


def test_sync_due():
    queued = [lane(job(began=NOW), job())]
    assert due(queued, flights=policy.FLIGHTS, urgent=True) == INF  # never more in flight
    assert due(queued, urgent=True) == NOW
    assert due(queued) == INF  # nothing to say, nothing to claim for
    assert due(queued, outbox_since=NOW - 1) == NOW - 1 + FLUSH_AFTER  # waited long enough: due
    assert due(queued, outbox_since=NOW - 0.001, flights=1) == NOW - 0.001 + FLUSH_AFTER
    assert due(queued, outbox_since=NOW, flights=1, stopping=True) == NOW
    assert due(queued, notes_due=NOW + 0.3) == NOW + 0.3
    assert due([lane()], can_claim=True) == NOW  # an idle child: claim now
    assert due([lane()], can_claim=False) == INF
    assert due([lane(open=False)], can_claim=True) == INF  # no room in a child being stopped
    # A child that runs several at once: its results wait while it holds more than its slots;
    # two jobs running in four slots, none waiting (an idle async worker's), go at once.
    assert due([spare_lane(4, 1)], outbox_since=NOW - 0.001) == NOW - 0.001 + FLUSH_AFTER
    assert due([spare_lane(2, 0)], outbox_since=NOW - 0.001) == NOW
    assert due([spare_lane(1, 0)], outbox_since=NOW - 0.001) == NOW


def test_a_busy_workers_results_wait_for_company_with_no_sync_in_flight_and_a_lone_ones_go_at_once():
    """Jobs that make a Redis round trip themselves (bench --metrics rt) end a few at a
    time, and Redis answers a one-result sync before the next ends: results sent at once
    whenever no sync was in flight went ~1.5 a finish.lua call. A child with jobs queued
    runs them without us, so its results wait FLUSH_AFTER for company; a lone job's (its
    child has nothing queued) still go at once, and so do a stopping worker's."""
    busy = [lane(job(began=NOW), job()), lane(job(began=NOW))]
    assert due(busy, outbox_since=NOW - 0.001) == NOW - 0.001 + FLUSH_AFTER
    assert due(busy, outbox_since=NOW, stopping=True) == NOW
    assert due([lane(job(began=NOW))], outbox_since=NOW) == NOW  # a lone job: nothing to wait for
    assert due([lane()], outbox_since=NOW) == NOW  # an idle worker's last result
    # A child down to half of its depth claims now, and the results go with the claim.
    assert due([lane(job(began=NOW), job()), lane()], outbox_since=NOW, can_claim=True) == NOW


def test_a_sync_claims_only_once_a_child_is_hungry_then_for_every_child_with_room():
    """A sync that goes for results alone claimed for whatever room the children had,
    a job or two each time (bench --metrics rt: a claim.lua call per 3.7 jobs); one claim
    now waits until a child is down to half of its depth, and fills every child."""
    def lanes(*counts: int) -> list[Lane]:
        return [lane(job(began=NOW), *[job() for _ in range(n - 1)]) for n in counts]

    assert policy.claim_slots(lanes(7, 6), 8, NOW) == []  # room, but no child is hungry
    fed = lanes(7, 4)
    got = policy.claim_slots(fed, 8, NOW)
    assert [c for c, _ in got].count(fed[0]) == 1 and [c for c, _ in got].count(fed[1]) == 4
    assert policy.claim_slots([lane()], 8, NOW) != []  # an idle child: at once
    assert policy.claim_slots([lane(open=False)], 8, NOW) == []
    loop = spare_lane(3, 0)  # a child that runs several at once, with a free slot
    assert [c for c, _ in policy.claim_slots([loop], 1, NOW, spare=2)] == [loop] * 3
    assert policy.claim_slots([spare_lane(4, 2)], 1, NOW, spare=2) == []  # its spare jobs: enough


def timeout(lanes, **kw) -> float:
    args = dict(redis_ok_at=0.0, next_beat=NOW + 3, sync_at=INF, answer_by=None, stopping=False,
                stop_at=0.0, give_up_at=0.0)
    return policy.wait_timeout(NOW, lanes, **{**args, **kw})


def test_wait_timeout_only_counts_what_is_still_ahead():
    assert timeout([]) == approx(3.0)  # the next heartbeat
    assert timeout([], next_beat=NOW + 60) == approx(policy.IDLE_MAX)
    assert timeout([], redis_ok_at=NOW + 0.4, sync_at=NOW) == approx(0.4)  # backing off: Redis waits
    assert timeout([], answer_by=NOW + 1) == approx(1.0)
    assert timeout([lane(job(2.0, began=NOW - 1))]) == approx(1.0)  # its deadline
    assert timeout([lane(job(2.0, began=NOW - 3, stuck=True))]) == approx(3.0)  # flagged already: not again
    assert timeout([lane(job(60, began=NOW - 0.5), job())]) == approx(HOLD - 0.5)  # hand back what waits
    assert timeout([lane(kill_at=NOW + 0.25)]) == approx(0.25)
    assert timeout([], stopping=True, stop_at=NOW + 2) == approx(2.0)
    assert timeout([], stopping=True, stop_at=NOW - 1, give_up_at=NOW + 1.5) == approx(1.5)
    assert timeout([lane(job(1.0, began=NOW - 5))]) == approx(0.0)  # past due and not acted on yet


def test_after_the_queues_were_found_empty_a_claim_asks_one_job_per_child():
    """A lone job's claim asked for every child's whole depth (2 x 128 with short jobs),
    each checked by claim.lua and written by the worker: a lone job began ~0.9 ms later
    (bench --metrics latency). Probing, a claim asks one per child with room, in order."""
    idle = [lane(), lane(), lane(open=False)]
    assert len(policy.claim_slots(idle, 128, NOW)) == 256
    got = policy.claim_slots(idle, 128, NOW, probing=True)
    assert [c for c, _ in got] == idle[:2] and [a for _, a in got] == [0.0, 0.0]
    busy = [lane(job(began=NOW)), lane()]
    assert [c for c, _ in policy.claim_slots(busy, 8, NOW, probing=True)] == busy
