"""Batched speculative decoding at pp = 1: many requests' rows in one forward (batcher.py) over
a paged KV cache (blocks.py, paged.py), each request's session over its own slot (slot.py),
behind `open_engine(..., max_batch=B)` (backend.py)."""
