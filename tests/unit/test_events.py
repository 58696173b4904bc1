"""controller.events: an Event per distinct occurrence, counted the way client-go counts."""

from __future__ import annotations

from controller.events import Occurrences

KEY = ("serving", "uid-1", "Warning", "GroupRestarting", "decode group of c0 restarts")


def test_the_first_occurrence_creates_an_event() -> None:
    write = Occurrences().record(KEY, "dsv4.1", "t0")
    assert write.create and (write.name, write.count, write.first_timestamp) == ("dsv4.1", 1, "t0")


def test_the_same_event_again_bumps_count_and_last_timestamp_of_the_first() -> None:
    seen = Occurrences()
    seen.record(KEY, "dsv4.1", "t0")
    again = seen.record(KEY, "dsv4.2", "t1")
    assert not again.create
    assert (again.name, again.count, again.first_timestamp, again.last_timestamp) == (
        "dsv4.1",
        2,
        "t0",
        "t1",
    )
    assert seen.record(KEY, "dsv4.3", "t2").count == 3


def test_another_message_is_another_event() -> None:
    seen = Occurrences()
    seen.record(KEY, "dsv4.1", "t0")
    other = seen.record((*KEY[:4], "decode group of c1 restarts"), "dsv4.2", "t1")
    assert other.create and other.name == "dsv4.2"


def test_an_expired_event_is_created_again() -> None:
    seen = Occurrences()
    seen.record(KEY, "dsv4.1", "t0")
    seen.forget(KEY)
    assert seen.record(KEY, "dsv4.2", "t1").create


def test_the_least_recently_seen_are_forgotten_past_capacity() -> None:
    seen = Occurrences(capacity=2)
    keys = [(*KEY[:4], f"message {i}") for i in range(3)]
    seen.record(keys[0], "a", "t0")
    seen.record(keys[1], "b", "t0")
    seen.record(keys[0], "a", "t1")  # seen again: now the most recent
    seen.record(keys[2], "c", "t2")  # evicts keys[1]
    assert seen.record(keys[0], "x", "t3").count == 3
    assert seen.record(keys[1], "y", "t3").create
