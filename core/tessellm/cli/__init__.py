"""The `tessellm` command line."""
