"""tessellm-fast-rms-norm: torch's fused rms_norm offered to the cpu device's profiler."""
