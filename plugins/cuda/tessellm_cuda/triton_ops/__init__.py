"""Triton kernels with the reference ops' signatures. Each module is imported only once the
device that uses it is available: `triton.jit` decides at import time whether a kernel is
compiled for the GPU or run by the interpreter (TRITON_INTERPRET=1)."""
