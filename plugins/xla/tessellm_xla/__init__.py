"""tessellm's XLA device plugin on torch-xla: every step padded to one of a small, known set
of static shapes (compiled once each, before the first request), portable torch kernels that
never read the host. Tested on PJRT's CPU client (PJRT_DEVICE=CPU); TPUs use the same code."""
__version__ = "0.1.0"
