"""controller/runtime.py's work queue: client-go's de-duplication and retry semantics."""

from __future__ import annotations

from controller.runtime import WorkQueue


def test_a_key_queued_twice_is_handed_out_once() -> None:
    queue = WorkQueue()
    queue.add("ns-a")
    queue.add("ns-b")
    queue.add("ns-a")
    assert [queue.get(0.01), queue.get(0.01), queue.get(0.01)] == ["ns-a", "ns-b", None]


def test_a_key_added_while_processing_comes_back_after_done_never_concurrently() -> None:
    queue = WorkQueue()
    queue.add("ns-a")
    assert queue.get(0.01) == "ns-a"
    queue.add("ns-a")
    assert queue.get(0.01) is None  # still being processed
    queue.done("ns-a")
    assert queue.get(0.01) == "ns-a"


def test_retries_back_off_exponentially_until_forgotten() -> None:
    queue = WorkQueue(base_s=0.01, cap_s=0.04)
    assert [queue.retry("ns-a") for _ in range(4)] == [0.01, 0.02, 0.04, 0.04]
    queue.forget("ns-a")
    assert queue.retry("ns-a") == 0.01


def test_a_delayed_key_is_handed_out_after_its_delay() -> None:
    queue = WorkQueue()
    queue.add_after("ns-a", 0.05)
    assert queue.get(0.001) is None
    assert queue.get(1.0) == "ns-a"


def test_close_wakes_a_waiting_worker() -> None:
    queue = WorkQueue()
    queue.close()
    assert queue.get(5.0) is None
