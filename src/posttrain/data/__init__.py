"""Prompt sources: the built-in arithmetic generator, JSONL files, local Hugging Face datasets and
custom factories. ``build_data_source`` picks one from ``rl.data``."""
