"""Batched speculative decoding: many requests' rows in one forward (batcher.py) over a paged KV
cache (blocks.py, paged.py), each request's session over its own slot (slot.py), behind
`open_engine(..., max_batch=B)` (backend.py); at pp > 1 the step goes down the ring as one plan
(step_plan.py, pipeline/batch_head.py)."""
