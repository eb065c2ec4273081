"""tessellm's CUDA device plugin: Triton kernels, a caching allocator with accounting, a pinned
host pool, transfer streams with events and CUDA graphs for decode. It imports only
`tessellm.plugin_api` from tessellm. The same Triton kernels also run on CPU tensors through
Triton's interpreter as the `triton-interpret` device (TRITON_INTERPRET=1), which is how CI
checks them without a GPU."""
__version__ = "0.1.0"
