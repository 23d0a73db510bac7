"""Models: HF config.json -> ModelConfig, blocks over a layer range, safetensors loading."""
