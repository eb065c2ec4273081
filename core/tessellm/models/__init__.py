"""Model architectures and loading: HF config, safetensors weights, tokenizers, the demo model."""
