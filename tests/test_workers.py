"""The shared worker pool takes tasks from its clients in turn."""

from __future__ import annotations

import threading

from damacy_server.workers import WorkerPool


def test_one_greedy_key_does_not_starve_another():
    pool = WorkerPool(1, "test")
    order: list[str] = []
    gate = threading.Event()
    done = threading.Event()
    pool.submit(gate.wait)  # hold the only worker while the queues fill
    for i in range(100):
        pool.submit(order.append, f"greedy{i}", key="greedy")
    for i in range(3):
        pool.submit(order.append, f"light{i}", key="light")
    pool.submit(done.set, key="light")
    gate.set()
    assert done.wait(60)
    # the light client's tasks ran after at most one greedy task each, not after all 100
    assert order.index("light2") <= 6, order[:10]
    pool.close()


def test_a_failing_task_does_not_kill_the_worker():
    pool = WorkerPool(1, "test")
    done = threading.Event()
    pool.submit(lambda: 1 / 0)
    pool.submit(done.set)
    assert done.wait(60)
    pool.close()


def test_a_closed_pool_drops_or_drains_what_is_queued_and_what_comes_after():
    ran: list[str] = []
    for drain in (False, True):
        pool = WorkerPool(1, "test")
        gate, started = threading.Event(), threading.Event()
        pool.submit(lambda started=started, gate=gate: (started.set(), gate.wait()))  # holds the only worker
        assert started.wait(60)
        pool.submit(ran.append, f"queued-{drain}")
        closer = threading.Thread(target=pool.close, kwargs={"drain": drain})
        closer.start()
        while not pool._closed:  # the close has begun: the worker is still busy
            threading.Event().wait(0.001)
        pool.submit(ran.append, f"after-close-{drain}")  # a task's follow-up, its worker alive
        gate.set()
        closer.join(60)
        pool.submit(ran.append, f"after-exit-{drain}")  # every worker gone
    assert ran == ["queued-True", "after-close-True", "after-exit-True"]
