"""Importers: Hugging Face checkpoints and GGUF files to CMF v2."""
