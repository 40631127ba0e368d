"""The driver keeps the objects alive at a run's start out of full GC passes, for the run only
(fabric_model/driver/heap.py; docs/architecture.md, "Scale")."""

from __future__ import annotations

import gc
import weakref

from fabric_model.driver.heap import long_lived_frozen


class _Node:
    def __init__(self) -> None:
        self.other: _Node | None = None


def _cycle() -> _Node:
    a, b = _Node(), _Node()
    a.other, b.other = b, a
    return a


def test_objects_of_before_the_run_wait_for_its_end_and_are_collected_then():
    node = _cycle()  # a cycle made before the run, let go of during it
    before = weakref.ref(node)
    with long_lived_frozen() as frozen:
        assert frozen and gc.get_freeze_count() > 0
        del node
        during = weakref.ref(_cycle())  # made during the run: collected as always
        gc.collect()
        assert during() is None
        assert before() is not None  # frozen: no pass reads it
    assert gc.get_freeze_count() == 0
    gc.collect()
    assert before() is None  # given back: the next collection frees it


def test_a_process_that_froze_objects_itself_is_left_as_it_is():
    gc.freeze()
    try:
        count = gc.get_freeze_count()  # it goes down as frozen objects are freed: never to 0 here
        with long_lived_frozen() as frozen:
            assert not frozen and count // 2 < gc.get_freeze_count() <= count
        assert count // 2 < gc.get_freeze_count() <= count  # its freeze is not undone (that would make it 0)
    finally:
        gc.unfreeze()
