"""tessellm-sim: a simulated accelerator device, packaged as an out-of-tree tessellm plugin."""
__version__ = "0.1.0"
