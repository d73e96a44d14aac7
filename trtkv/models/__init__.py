"""The decoder (Llama / Qwen2), the model registry, weight fetching and conversion."""
