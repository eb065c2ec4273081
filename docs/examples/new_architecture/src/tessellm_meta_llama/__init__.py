"""tessellm-meta-llama: serves Llama checkpoints written in Meta's original layout."""
