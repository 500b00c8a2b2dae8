"""engine.heap: after loading, garbage is collected once and everything alive leaves the collector's walks."""

from __future__ import annotations

import gc
import weakref

from kakeya_runtime.engine.heap import freeze_heap


class Node:
    def __init__(self) -> None:
        self.other: Node | None = None


def test_freeze_collects_garbage_then_freezes_what_is_alive():
    a, b = Node(), Node()
    a.other, b.other = b, a  # a cycle: only the collector frees it
    dead = weakref.ref(a)
    del a, b
    kept = Node()
    before = gc.get_freeze_count()
    try:
        freeze_heap()
        assert dead() is None  # the cycle was collected before freezing
        assert gc.get_freeze_count() > before
        # objects alive at the call sit in the permanent generation: no generation lists them any more
        assert not any(o is kept for o in gc.get_objects())
    finally:
        gc.unfreeze()
    assert any(o is kept for o in gc.get_objects())  # unfrozen: tracked again
