"""The scheduler simulator behind `tessellm bench schedule`: a synthetic trace (trace.py)
replayed through the real Scheduler and KVCacheManager on a virtual clock, with a cost model
in place of the model (replay.py)."""
