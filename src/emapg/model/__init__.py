"""Models: loading (built-in, Hugging Face, GGUF), the LM head's chunked passes, LoRA, the anchor."""
