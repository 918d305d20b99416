"""Cyclic garbage collection paused around work that allocates many objects that are all
still alive when it ends (reading a large configuration, building a scrape's page)."""

from __future__ import annotations

import contextlib
import gc
import threading
from collections.abc import Iterator


@contextlib.contextmanager
def paused_gc() -> Iterator[None]:
    """No cyclic garbage collection in the block (the whole process; restored after the
    last of several blocks that overlap, in any threads or tasks, ends).

    Reading a large configuration allocates O(tenants) objects that all stay alive until it
    is built: every full collection on the way walks them all, finds nothing, and holds the
    GIL meanwhile (a reload reads in a worker thread, so the event loop waits that out). A
    scrape of thousands of tenants' series allocates enough short-lived objects to set off
    a full collection of a heap holding every series. Nothing these blocks make is cyclic
    garbage; plain reference counting still frees everything as usual. Cost: one lock and
    a counter per block. docs/benchmarks measures the pauses this avoids.
    """
    global _gc_pauses, _gc_was_enabled
    with _gc_lock:
        if _gc_pauses == 0:
            _gc_was_enabled = gc.isenabled()
            gc.disable()
        _gc_pauses += 1
    try:
        yield
    finally:
        with _gc_lock:
            _gc_pauses -= 1
            if _gc_pauses == 0 and _gc_was_enabled:
                gc.enable()


_gc_lock = threading.Lock()
_gc_pauses = 0  # paused_gc blocks running now
_gc_was_enabled = True
