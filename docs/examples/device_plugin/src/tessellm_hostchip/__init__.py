"""tessellm-hostchip: the tutorial's device plugin (a device whose memory is host memory)."""
