"""tessellm's CPU device plugin, found through the `tessellm.plugins` entry point."""
