"""What a step costs when every running request is throttled: no object per request.

A step that holds an object per throttled request crosses the garbage collector's
threshold (700 objects) at a few hundred running requests, so every such step set off a
collection, and the process's next full collection (whose cost grows with the whole
heap) often fell on it: at 1,024 running that doubled the step's CPU
(``tokenpace bench scheduler``; docs/benchmarks/scheduler.md)."""

from __future__ import annotations

import pytest

from tests._gc import collections_during
from tests.sched._harness import make_sim

RUNNING = 1024


@pytest.mark.parametrize("is_async", [False, True], ids=["sync", "async"])
def test_an_all_throttled_step_sets_off_no_garbage_collection(tiny_model, is_async):
    pacing = {"default_user_output_tokens_per_second": 1e-6}  # one token, then none for days
    sim = make_sim(tiny_model, is_async=is_async, pacing=pacing, max_num_seqs=RUNNING,
                   max_num_batched_tokens=RUNNING * 16, num_blocks=RUNNING * 4 + 16)
    for i in range(RUNNING):
        sim.add(f"r{i}", f"u{i}", prompt_len=16, max_tokens=100)
    for _ in range(4):  # admitted, prefilled, each user's one token spent
        sim.step()
    with collections_during() as collections:
        outputs = [sim.step() for _ in range(3)]
    assert all(not out.num_scheduled_tokens for out in outputs)
    assert len(sim.scheduler.running) == RUNNING
    assert collections == []
