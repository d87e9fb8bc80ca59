"""Turn prompts into token ids (chat template or raw text) and find the ids that end a completion."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from posttrain.errors import ConfigError, DataError


def _check_messages(messages: list[Any]) -> list[dict[str, Any]]:
    if not messages:
        raise DataError("a chat prompt is an empty message list; give at least one message")
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict) or not isinstance(msg.get("role"), str) or not isinstance(msg.get("content"), str):
            raise DataError(
                f"chat prompt message {i} is {msg!r}; each message must be a dict with string 'role' and 'content'"
            )
    return messages


def render_prompt_ids(
    tokenizer: Any,
    prompt: str | list[dict[str, Any]],
    *,
    use_chat_template: bool,
    chat_template_kwargs: Mapping[str, Any] | None = None,
) -> list[int]:
    """Token ids of ``prompt``, ready for generation.

    With ``use_chat_template`` and a tokenizer that has a template, the prompt is rendered with
    ``add_generation_prompt=True`` (a plain string becomes one user message) and the template
    variables of ``chat_template_kwargs`` (``model.chat_template_kwargs``, e.g. ``enable_thinking``);
    the rendered text already holds its special tokens, so it is tokenized without adding more.
    Otherwise the raw string is tokenized with the tokenizer's default special tokens (a BOS where
    it adds one).
    """
    has_template = bool(getattr(tokenizer, "chat_template", None))
    if use_chat_template and has_template:
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else _check_messages(prompt)
        text = tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=False, **dict(chat_template_kwargs or {})
        )
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])
    if not isinstance(prompt, str):
        why = "model.use_chat_template is false" if not use_chat_template else "the tokenizer has no chat template"
        raise ConfigError(
            [
                f"a prompt is a chat-message list but {why}; give plain-string prompts, or use a tokenizer with a "
                "chat template and model.use_chat_template=true"
            ]
        )
    return list(tokenizer(prompt)["input_ids"])


def _as_id_list(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


def eos_token_ids(tokenizer: Any, model_config: Any, *, generation_config: Any = None) -> list[int]:
    """Every id that ends a completion: the tokenizer's EOS plus the ``eos_token_id`` of the model
    config and of the generation config (SmolLM2-Instruct: ``<|im_end|>``), in that order, deduplicated."""
    ids: list[int] = []
    for source in (getattr(tokenizer, "eos_token_id", None), getattr(model_config, "eos_token_id", None)):
        ids += _as_id_list(source)
    if generation_config is not None:
        ids += _as_id_list(getattr(generation_config, "eos_token_id", None))
    unique = list(dict.fromkeys(ids))
    if not unique:
        raise ConfigError(["model.name_or_path: neither the tokenizer nor the model config names an EOS token"])
    return unique
