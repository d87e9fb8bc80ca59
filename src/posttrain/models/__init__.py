"""Model resolution and loading: the embedded default model, local Hugging Face directories, tiny
random models for tests, and chat-template rendering.

Nothing here is imported eagerly: ``posttrain.models.embedded`` and ``posttrain.models.loading``
import torch and transformers only inside the functions that need them, so that resolving a path
stays cheap.
"""
