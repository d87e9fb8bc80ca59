"""The cross-tokenizer teacher's own prompt: its chat template plus exactly one think prefix.

In ``cross_token_text`` mode the teacher never sees the student's token ids. It renders the prompt
with its own template (``add_generation_prompt=True``), optionally conditions the answer with
``rl.teacher.conditional_think_prefix`` (for example an empty closed think block that tells a
reasoning teacher not to think), and then tokenizes the student's completion *text* with its own
tokenizer. Some templates already emit an empty closed think block at the end of the generation
prompt even when thinking is off; that block is removed before the configured prefix is inserted,
so the conditioning appears exactly once. Missing, duplicate or misplaced conditioning fails
before any scoring.
"""

from __future__ import annotations

import re
from typing import Any

from posttrain.teacher.base import TeacherError

# An empty closed think block at the very end of the rendered generation prompt.
EMPTY_THINK_SUFFIX = re.compile(r"<think>\s*</think>\s*$")


def render_teacher_prefix(
    tokenizer: Any,
    prompt: str | list[dict[str, Any]],
    *,
    use_chat_template: bool,
    think_prefix: str | None,
) -> str:
    """The teacher's prompt text, ending exactly where the completion begins."""
    if use_chat_template and getattr(tokenizer, "chat_template", None):
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        text = str(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False))
    elif isinstance(prompt, str):
        text = prompt
    else:
        raise TeacherError("a chat-message prompt needs a teacher tokenizer with a chat template")
    if not think_prefix:
        return text
    text = EMPTY_THINK_SUFFIX.sub("", text)
    rendered = text + think_prefix
    check_single_prefix(rendered, think_prefix)
    return rendered


def check_single_prefix(rendered: str, think_prefix: str) -> None:
    """The conditioning must occur once, at the end of the teacher's prompt."""
    count = rendered.count(think_prefix)
    if count != 1 or not rendered.endswith(think_prefix):
        where = "missing" if count == 0 else ("duplicated" if count > 1 else "not at the end of the prompt")
        raise TeacherError(
            f"rl.teacher.conditional_think_prefix {think_prefix!r} is {where} in the teacher's rendered prompt "
            f"(found {count} time(s)); the prompt itself may contain it"
        )
