"""Where hcache's helper threads run: on the cores an engine left over, at the lowest priority, so that the
engine's own processes there come first; anywhere, at their starter's priority, where none are named."""

import os
import threading

from hcache.machine import helper_threads


def _where_and_nice() -> tuple[set[int], int]:
    tid = threading.get_native_id()
    return os.sched_getaffinity(0), os.getpriority(os.PRIO_PROCESS, tid)


def test_helpers_run_on_the_named_cores_at_the_lowest_priority_and_else_as_their_starter():
    mine = os.sched_getaffinity(0)
    starter = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    one = {min(mine)}
    try:
        helper_threads.run_on(one)
        with helper_threads.executor(1, "test-helper") as pool:
            assert pool.submit(_where_and_nice).result() == (one, helper_threads.LOWEST)
    finally:
        helper_threads.run_on(())
    with helper_threads.executor(1, "test-helper") as pool:
        assert pool.submit(_where_and_nice).result() == (mine, starter)
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == starter  # the starter's own is untouched
