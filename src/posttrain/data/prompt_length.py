"""Prompt lengths against the model's context, counted before any model loads (for the preflight).

A prompt of ``T`` tokens leaves room for ``max_position_embeddings - T`` generated tokens; a prompt
longer than ``max_position_embeddings - rollout.max_tokens`` cannot be sampled in full and used to
be accepted silently. ``PromptCounter`` counts prompt tokens the way the loop renders them
(``posttrain.models.chat.render_prompt_ids``: the tokenizer's chat template with the generation
prompt, or the raw text), from the model directory's ``tokenizer.json``, ``tokenizer_config.json`` /
``chat_template.jinja`` and ``config.json`` alone: the ``tokenizers`` library and transformers'
jinja renderer, never torch and never the weights.

The count leaves out the BOS/EOS a raw prompt may get from the tokenizer's post-processor (at
most a couple of tokens): it can let a prompt within two tokens of the limit through, never refuse
one that fits.

Counting every row exactly costs about 70 us a row (jinja plus BPE); a million-row file would take
over a minute. So each row first gets a cheap upper bound: a byte-level BPE token covers at least one
UTF-8 byte, so a rendered prompt has at most as many tokens as bytes, and its bytes are the
contents' bytes plus the template's own text, measured once per sequence of roles. Only rows whose
bound exceeds the limit are rendered and counted exactly. (Tokenizers whose normaliser expands text,
e.g. NFKC of ligatures, can beat the bound by a few tokens on such characters.)
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from posttrain.data.base import ChatMessages

_SLACK_BYTES = 16  # the tokens a post-processor or a template's own branches may add beyond the bound
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
_COUNTERS: dict[tuple[object, ...], PromptCounter] = {}
_POSITION_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length", "n_ctx")


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def max_positions(model_dir: Path) -> int | None:
    """The context length ``config.json`` declares (the text model's, for a multimodal config); None when
    the file is unreadable or declares none."""
    return positions_in(_read_json(model_dir / "config.json"))


def positions_in(config: Any) -> int | None:
    """The context length a model config (``config.json``'s contents, or a loaded config's
    ``to_dict()``) declares, the text model's for a multimodal one; None when it declares none."""
    for section in (config, config.get("text_config") if isinstance(config, dict) else None):
        if isinstance(section, dict):
            for key in _POSITION_KEYS:
                value = section.get(key)
                if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                    return value
    return None


def _token_text(value: Any) -> Any:
    # tokenizer_config.json writes special tokens as strings or as AddedToken objects.
    return value.get("content") if isinstance(value, dict) else value


def _chat_template(model_dir: Path, tok_config: dict[str, Any]) -> str | None:
    jinja = model_dir / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    template = tok_config.get("chat_template")
    if isinstance(template, list):  # named templates: the loop renders with the default one
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) and template else None


@dataclass
class PromptBudget:
    """How many prompt tokens fit: ``max_positions - max_tokens``."""

    max_positions: int
    max_tokens: int
    context: str = "the model's context (max_position_embeddings={n})"
    """How the limit is named in messages; ``{n}`` is ``max_positions``."""

    @property
    def limit(self) -> int:
        return self.max_positions - self.max_tokens

    def describe(self, tokens: int, remedy: str = "shorten or drop the row") -> str:
        return (
            f"the prompt is {tokens} tokens, but {self.context.format(n=self.max_positions)} "
            f"minus rollout.max_tokens={self.max_tokens} leaves {self.limit} for it; {remedy}, or "
            "lower rollout.max_tokens"
        )


def prompt_budget(positions: int | None, rollout: Any) -> PromptBudget | None:
    """What a rendered prompt may take: the model's context (``positions``), or a vLLM engine's smaller
    ``rollout.max_model_len``, less ``rollout.max_tokens``; None when neither is known. One rule for
    the preflight's row pass (``data.rows``) and the run's check of each rendered prompt
    (``loop.collect.check_prompt_lengths``), which covers what the preflight cannot count: prompts
    whose model is not on disk yet, or that a factory builds. ``rollout``: the config's section."""
    engine_max_len = rollout.max_model_len if rollout.backend == "vllm" else None
    if engine_max_len is not None and (positions is None or engine_max_len < positions):
        return PromptBudget(engine_max_len, rollout.max_tokens, "the engine's context (rollout.max_model_len={n})")
    return None if positions is None else PromptBudget(positions, rollout.max_tokens)


class PromptCounter:
    """Prompt token counts of one model directory's tokenizer, as ``render_prompt_ids`` renders them."""

    def __init__(
        self, model_dir: Path, *, use_chat_template: bool, template_kwargs: dict[str, Any] | None = None
    ) -> None:
        import tokenizers

        self.tokenizer = tokenizers.Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        tok_config = _read_json(model_dir / "tokenizer_config.json")
        tok_config = tok_config if isinstance(tok_config, dict) else {}
        template = _chat_template(model_dir, tok_config)
        self.template = template if use_chat_template else None
        self.specials = {
            key: _token_text(value)
            for key, value in tok_config.items()
            if key.endswith("_token") and isinstance(_token_text(value), str)
        }
        self.template_kwargs = dict(template_kwargs or {})  # ``model.chat_template_kwargs``, as the loop renders
        self._glue: dict[tuple[str, ...], int] = {}

    @classmethod
    def for_model(
        cls, model_dir: Path, *, use_chat_template: bool, template_kwargs: dict[str, Any] | None = None
    ) -> PromptCounter | None:
        """A counter when the directory holds a ``tokenizer.json`` the ``tokenizers`` library reads, else
        None. Cached per directory while its tokenizer files are unchanged."""
        try:
            stamp = tuple(
                (p.stat().st_mtime_ns, p.stat().st_size) if p.is_file() else None
                for p in (model_dir / name for name in _TOKENIZER_FILES)
            )
        except OSError:
            return None
        if stamp[0] is None:
            return None
        key = (str(model_dir), use_chat_template, repr(sorted((template_kwargs or {}).items())), stamp)
        if key not in _COUNTERS:
            try:
                _COUNTERS[key] = cls(model_dir, use_chat_template=use_chat_template, template_kwargs=template_kwargs)
            except Exception:  # an unreadable tokenizer is the model loader's to report, with its own message
                return None
        return _COUNTERS[key]

    def render(self, messages: ChatMessages) -> str:
        """The chat template applied with the generation prompt (as ``apply_chat_template`` does)."""
        from transformers.utils.chat_template_utils import render_jinja_template

        # (the rendered conversations, generation indices)
        out: Any = render_jinja_template(
            conversations=[messages],
            chat_template=self.template,
            add_generation_prompt=True,
            **{**self.specials, **self.template_kwargs},
        )
        return str(out[0][0])

    def _messages(self, prompt: str | ChatMessages) -> ChatMessages:
        return [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt

    def upper_bound(self, prompt: str | ChatMessages) -> int:
        """At least the prompt's token count (see the module docstring); cheap after the first row of
        each role sequence."""
        if self.template is None:
            assert isinstance(prompt, str)  # message lists without a template are refused by the caller
            return len(prompt.encode("utf-8")) + _SLACK_BYTES
        messages = self._messages(prompt)
        roles = tuple(str(m["role"]) for m in messages)
        glue = self._glue.get(roles)
        if glue is None:
            probe = [{**m, "content": "x"} for m in messages]
            glue = self._glue[roles] = len(self.render(probe).encode("utf-8")) - len(probe)
        return glue + sum(len(str(m["content"]).encode("utf-8")) for m in messages) + _SLACK_BYTES

    def count(self, prompt: str | ChatMessages) -> int:
        """The prompt's token count (without the post-processor's BOS/EOS for a raw prompt)."""
        if self.template is None:
            assert isinstance(prompt, str)
            text = prompt
        else:
            text = self.render(self._messages(prompt))
        return len(self.tokenizer.encode(text, add_special_tokens=False).ids)

    def too_long(self, prompt: str | ChatMessages, budget: PromptBudget) -> int | None:
        """The prompt's token count when it exceeds ``budget.limit``, else None."""
        if self.upper_bound(prompt) <= budget.limit:
            return None
        tokens = self.count(prompt)
        return tokens if tokens > budget.limit else None
