"""The typed outcome: what each constructor puts in finish.lua's slots, and that a child's
malformed reply is refused rather than misrecorded."""

import pytest

from taskrunner.protocol.outcome import Ended, Outcome, finish_values


def test_constructors_fill_finish_lua_slots():
    assert Outcome.completed("[1]").wire() == ["completed", "[1]", "", "", ""]
    assert Outcome.failed("ValueError", "bad", "tb").wire() == ["failed", "ValueError", "bad", "tb", ""]
    assert Outcome.error("E", "m", "tb", 0.75).wire() == ["error", "E", "m", "tb", "0.75"]
    assert Outcome.killed("by hand").wire() == ["killed", "", "by hand", "", ""]
    assert Outcome.requeue(2.5).wire() == ["requeue", "2.5", "", "", ""]
    assert Outcome.requeue(front=True, why="stopping").wire() == ["requeue", "0.0", "front", "stopping", ""]
    assert Outcome.lost("SIGKILL").wire() == ["lost", "SIGKILL", "", "", ""]
    assert Outcome.returned("handed back").wire() == ["return", "handed back", "", "", ""]


def test_readable_fields_for_hooks():
    assert Outcome.completed('{"a": 1}').result == {"a": 1}
    assert Outcome.failed("ValueError", "bad").error_type == "ValueError"
    assert Outcome.failed("ValueError", "bad").message == "bad"
    assert Outcome.killed("by hand").error_type == "Killed"
    assert Outcome.requeue(front=True, why="stopping").message == "stopping"
    assert Outcome.lost("SIGKILL").message == "SIGKILL"
    assert Outcome.error("E", "m").result is None


@pytest.mark.parametrize("wire", [[], ["completed"], ["done", "", "", "", ""], ["completed", 1, "", "", ""],
                                  ["completed", "", "", "", "", ""]])
def test_malformed_wire_is_refused(wire):
    with pytest.raises(ValueError):
        Outcome.from_wire(wire)


def test_finish_values_are_eight_per_job_with_began_as_seconds_ago():
    values = finish_values([Ended("a", "1", Outcome.completed("1"), 10.0), Ended("b", "2", Outcome.lost("x"))], 12.5)
    assert values == ["a", "1", "completed", "2.500000", "1", "", "", "",
                      "b", "2", "lost", "", "x", "", "", ""]


def test_began_is_the_runtime_up_to_the_end_not_up_to_the_report():
    """A result that waited before its finish (to go with others, or for a slow Redis):
    finish.lua takes its own time as the end, so `began` is the runtime, not the time since."""
    values = finish_values([Ended("a", "1", Outcome.completed("1"), 10.0, "t", 10.25)], 10.5)
    assert values[3] == "0.250000"
    # One that waited longer than HELD (an outage): its start stays exact, not its runtime.
    assert finish_values([Ended("a", "1", Outcome.completed("1"), 10.0, "t", 10.25)], 14.0)[3] == "4.000000"
