"""The plain schedule replayed on row lengths: refills, compactions and cache buckets."""

from __future__ import annotations

from collections import Counter

from generation.schedule import plain_decode_steps


def test_rows_done_at_prefill_free_their_slot_and_the_rest_compact_as_they_finish():
    # 3 rows in a 4-slot batch; the middle one ends on its prefill token, so the other two
    # move to slots 0-1 (bucket 2) for 2 steps, then the longest alone runs at bucket 1.
    steps = plain_decode_steps([(10, 3), (10, 1), (10, 5)], [1, 2, 4], [64, 128])
    assert steps == Counter({(2, 64): 2, (1, 64): 2})


def test_waiting_rows_refill_free_slots_and_steps_cross_cache_buckets():
    # 6 rows of a 60-token prompt and 10 tokens: 4 run first, contexts 61..69 cross 64 after 4
    # steps; the last 2 take slots 0-1 and run at bucket 2.
    steps = plain_decode_steps([(60, 10)] * 6, [1, 2, 4], [64, 128])
    assert steps == Counter({(4, 64): 4, (4, 128): 5, (2, 64): 4, (2, 128): 5})
