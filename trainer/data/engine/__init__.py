"""The paged regeneration engine (data.regen_engine=paged): continuous batching over a paged KV cache.

scheduler.py decides, in plain Python, which sequence holds which slot and pages; kv_pages.py holds
the KV pages on the device and the block table that maps a slot's positions to pages; step.py runs
the target's layers over them (a prefill chunk of one slot, or a decode step of every slot at one
fixed shape); engine.py is the loop that ties them together."""

from .engine import PagedEngine, PagedSettings

__all__ = ["PagedEngine", "PagedSettings"]
