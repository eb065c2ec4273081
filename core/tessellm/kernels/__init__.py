"""Ops, their reference implementations, the kernel registry and the runtime profiler."""
