"""Checked scoring: ``score_completions`` is the only way the loop calls a reward.

It refuses a sample that lacks a field the reward requires and a score that is not a finite
number (``None``, a bool, text, NaN, an infinity, an integer too large for a float), so a broken
scorer or a missing answer can never pass as a legitimate zero. Every refusal is a ``RewardError``
naming the reward and the sample (its uid).

**Timeout.** A scorer that never returns would block the run for ever, and the first SIGTERM
(which only asks for a stop after the current batch) could not end it. So the scorer runs in a
worker thread and the calling thread waits at most ``timeout_s`` seconds per sample (per call for
a batched reward; ``rl.reward_timeout_s``, default 60) for it; past that the call fails with a
``RewardError`` naming the reward, the sample, the timeout and the key to raise it. A hung Python
function cannot be killed from outside its thread: the worker is a daemon thread, abandoned (it
does not keep the process alive at exit) and the run stops with the error. Signals still work
while the caller waits: the wait is interruptible, so a second SIGTERM / SIGINT
(``posttrain.checkpoint.graceful_stop``) stops the run at once. ``timeout_s=0`` calls the scorer in
the calling thread without a timeout (for scorers that need the main thread, e.g. ones that use
``signal.alarm``).

The worker takes on the calling thread's torch grad mode and current CUDA device (thread-local in
torch), so a scorer that runs a model behaves as it would in the loop's thread.

**Batched rewards.** A reward whose ``batched`` attribute is true is called once with the list of
inputs and returns one score per input, in order; a wrong count is a ``RewardError``.

**Async rewards.** A reward defined with ``async def`` (a function, or a class whose ``__call__`` is
one) is awaited on an event loop of its own in the worker thread. Unbatched, every sample's coroutine
runs at once on that loop (a judge behind an API scores the batch concurrently), each bounded by
``rl.reward_timeout_s`` (``asyncio.wait_for``; a sample that runs past it is named); a coroutine that
blocks the loop without awaiting is caught by the thread's backstop of twice the timeout (plus a
second), which names the batch. Batched, the one call's coroutine is awaited under the usual timeout.
"""

from __future__ import annotations

import asyncio
import inspect
import math
import numbers
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from posttrain.errors import RewardError
from posttrain.rewards.base import Reward, RewardInput

DEFAULT_REWARD_TIMEOUT_S = 60.0
"""The default of ``rl.reward_timeout_s``: how long one scorer call may take."""
_DEFAULT_REQUIRES = frozenset({"prompt"})
_TIMEOUT_KEY = "rl.reward_timeout_s"


def describe_value(value: Any, limit: int = 80) -> str:
    """A short, always-printable description of a value a reward returned or a sample holds
    (``repr`` of a 5000-digit int raises, and a long list would flood the message)."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 200:
        digits = int(value.bit_length() * math.log10(2)) + 1
        return f"an int of about {digits} digits"
    try:
        text = repr(value)
    except Exception:  # a broken __repr__ must not hide the real problem
        return f"a {type(value).__name__}"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _field_value(sample: RewardInput, field: str) -> Any:
    if hasattr(sample, field):
        return getattr(sample, field)
    return sample.metadata.get(field)


def _check_input(sample: RewardInput, name: str, requires: frozenset[str], label: str) -> None:
    if not isinstance(sample.completion, str):
        raise RewardError(
            f"reward {name!r}: {label} has a malformed completion {describe_value(sample.completion)} (expected text)"
        )
    for field in sorted(requires):
        if _field_value(sample, field) is None:
            hint = (
                "; set rl.data.response_column to the ground-truth column, or pick a reward that needs none"
                if field == "ground_truth"
                else ""
            )
            raise RewardError(
                f"reward {name!r}: {label} is missing field {field} (the reward requires {sorted(requires)}){hint}"
            )


def checked_score(value: Any, reward_name: str, label: str) -> float:
    """``value`` as a finite float, else a ``RewardError`` naming the reward, the sample and the value."""
    # bool is an int subclass but a True/False "score" is almost always a forgotten float().
    if value is None or isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise RewardError(
            f"reward {reward_name!r} returned {describe_value(value)} ({type(value).__name__}) for {label}; "
            "a reward must return a finite float"
        )
    try:
        score = float(value)
    except OverflowError:
        raise RewardError(
            f"reward {reward_name!r} returned {describe_value(value)} for {label}: too large for a float "
            "(beyond about 1.8e308); a reward must return a finite float"
        ) from None
    except (TypeError, ValueError, ArithmeticError) as exc:
        raise RewardError(
            f"reward {reward_name!r} returned {describe_value(value)} for {label}, which is not convertible to a "
            f"float ({type(exc).__name__}: {exc}); a reward must return a finite float"
        ) from None
    if not math.isfinite(score):
        raise RewardError(f"reward {reward_name!r} returned {score} for {label}; a reward must return a finite float")
    return score


class _Worker:
    """Runs ``call(0) .. call(n - 1)`` in a daemon thread and records what it is on, so the caller
    can time out the call in progress (and name it) without a thread switch per item."""

    def __init__(self, call: Callable[[int], Any], n: int) -> None:
        self.call, self.n = call, n
        self.values: list[Any] = []
        self.error: tuple[int, BaseException] | None = None
        self.current = (0, time.monotonic())  # (item, start time): one assignment, so read consistently
        self.done = threading.Event()

    def run(self, torch_state: tuple[bool, int | None] | None = None) -> None:
        if torch_state is not None:
            _enter_torch_state(torch_state)
        try:
            for i in range(self.n):
                self.current = (i, time.monotonic())
                try:
                    self.values.append(self.call(i))
                except BaseException as exc:  # reported by the caller, with the reward and sample named
                    self.error = (i, exc)
                    return
        finally:
            self.done.set()

    def wait(self, timeout_s: float) -> int | None:
        """Wait until every item is done; the item that ran past ``timeout_s``, else None."""
        if math.isinf(timeout_s):
            self.done.wait()
            return None
        remaining = timeout_s
        while not self.done.wait(remaining):
            item, started = self.current
            remaining = started + timeout_s - time.monotonic()
            if remaining <= 0 and not self.done.is_set():
                return item
        return None


def _torch_state() -> tuple[bool, int | None] | None:
    """torch's thread-local state a scorer may rely on (grad mode, the current CUDA device), when torch
    is in use: a new thread starts with grad enabled on device 0, not as the loop's thread runs."""
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    device = torch.cuda.current_device() if torch.cuda.is_initialized() else None
    return bool(torch.is_grad_enabled()), device


def _enter_torch_state(state: tuple[bool, int | None]) -> None:
    import torch

    grad, device = state
    torch.set_grad_enabled(grad)
    if device is not None:
        torch.cuda.set_device(device)


def _run_items(
    call: Callable[[int], Any], n: int, timeout_s: float
) -> tuple[list[Any], tuple[int, BaseException] | None, int | None]:
    """``(values, error, timed_out_item)`` of running ``call`` on items ``0 .. n-1`` in order."""
    worker = _Worker(call, n)
    if timeout_s <= 0:
        worker.run()
        return worker.values, worker.error, None
    thread = threading.Thread(target=worker.run, args=(_torch_state(),), name="posttrain-reward", daemon=True)
    thread.start()
    late = worker.wait(timeout_s)
    return worker.values, worker.error, late


def _awaited(value: Any) -> Any:
    """A coroutine's (any awaitable's) result, run to completion on a new event loop in this thread."""
    if not inspect.isawaitable(value):
        return value

    async def wait() -> Any:
        return await value

    return asyncio.run(wait())


def is_async_reward(reward: Any) -> bool:
    """Whether calling ``reward`` (or the function a ``FunctionReward`` wraps) makes a coroutine."""
    target = getattr(reward, "fn", reward)
    if inspect.iscoroutinefunction(target):
        return True
    return not inspect.isroutine(target) and inspect.iscoroutinefunction(type(target).__call__)


def _async_scores(
    reward: Reward, name: str, inputs: list[RewardInput], labels: list[str], timeout_s: float
) -> list[float]:
    """Every sample's coroutine at once on one event loop, each bounded by ``timeout_s`` (module docstring)."""
    call: Callable[[RewardInput], Any] = reward

    async def one(i: int) -> Any:
        coro = call(inputs[i])
        return await (asyncio.wait_for(coro, timeout_s) if timeout_s > 0 else coro)

    async def every() -> list[Any]:
        return await asyncio.gather(*(one(i) for i in range(len(inputs))), return_exceptions=True)

    backstop = 2 * timeout_s + 1 if timeout_s > 0 else 0
    values, error, late = _run_items(lambda _i: asyncio.run(every()), 1, backstop)
    label = f"the batch of {len(inputs)} samples ({labels[0]} .. {labels[-1]})"
    if late is not None:
        raise _timeout_error(name, f"{label} (its event loop was blocked)", timeout_s)
    if error is not None:
        exc = error[1]
        raise RewardError(f"reward {name!r} failed on {label}: {type(exc).__name__}: {exc}") from exc
    scores = []
    for value, item_label in zip(values[0], labels, strict=True):
        if isinstance(value, TimeoutError):
            raise _timeout_error(name, item_label, timeout_s)
        if isinstance(value, BaseException):
            raise RewardError(f"reward {name!r} failed on {item_label}: {type(value).__name__}: {value}") from value
        scores.append(checked_score(value, name, item_label))
    return scores


def _timeout_error(name: str, label: str, timeout_s: float) -> RewardError:
    return RewardError(
        f"reward {name!r} did not return within {_TIMEOUT_KEY}={timeout_s:g} s on {label}; the run stops (the scorer "
        f"is left running in an abandoned daemon thread: a Python function cannot be killed). If the reward is "
        f"legitimately this slow, raise {_TIMEOUT_KEY} (0 disables the timeout)"
    )


def _labels(inputs: Sequence[RewardInput], uids: list[str] | None) -> list[str]:
    if uids is None:
        return [f"sample index {i}" for i in range(len(inputs))]
    return [f"sample {uid!r} (index {i})" for i, uid in enumerate(uids)]


def _batch_scores(
    reward: Reward, name: str, inputs: list[RewardInput], labels: list[str], timeout_s: float
) -> list[Any]:
    label = f"the batch of {len(inputs)} samples ({labels[0]} .. {labels[-1]})"
    call: Callable[[Any], Any] = reward  # a batched reward takes the whole list
    values, error, late = _run_items(lambda _i: _awaited(call(inputs)), 1, timeout_s)
    if late is not None:
        raise _timeout_error(name, label, timeout_s)
    if error is not None:
        exc = error[1]
        raise RewardError(f"reward {name!r} failed on {label}: {type(exc).__name__}: {exc}") from exc
    out = values[0]
    if callable(getattr(out, "tolist", None)):  # a NumPy array or a tensor of scores
        out = out.tolist()
    if not isinstance(out, (list, tuple)):
        raise RewardError(
            f"reward {name!r} is batched but returned {describe_value(out)} ({type(out).__name__}) for {label}; "
            "a batched reward returns a list with one score per sample"
        )
    if len(out) != len(inputs):
        raise RewardError(
            f"reward {name!r} is batched but returned {len(out)} scores for {label}; a batched reward returns "
            "exactly one score per sample, in order"
        )
    return list(out)


def score_completions(
    reward: Reward, inputs: list[RewardInput], uids: list[str] | None = None, *, timeout_s: float | None = None
) -> list[float]:
    """Score every input with ``reward``; any missing field, bad score, exception or timeout is a
    ``RewardError`` naming the reward and the sample.

    ``uids`` (one per input) name the samples in errors; without them the index is used.
    ``timeout_s``: seconds one scorer call may take (0: no timeout, called in this thread); by
    default the reward's own ``timeout_s`` attribute (``get_reward(..., timeout_s=...)``), else
    ``DEFAULT_REWARD_TIMEOUT_S``. See the module docstring for what a timeout does.
    """
    if uids is not None and len(uids) != len(inputs):
        raise ValueError(f"score_completions got {len(uids)} uids for {len(inputs)} inputs")
    name = getattr(reward, "name", repr(reward))
    requires = getattr(reward, "requires", _DEFAULT_REQUIRES)
    labels = _labels(inputs, uids)
    for sample, label in zip(inputs, labels):
        _check_input(sample, name, requires, label)
    if not inputs:
        return []
    if timeout_s is None:
        timeout_s = getattr(reward, "timeout_s", None)
    timeout = DEFAULT_REWARD_TIMEOUT_S if timeout_s is None else float(timeout_s)
    if getattr(reward, "batched", False):
        values = _batch_scores(reward, name, inputs, labels, timeout)
        return [checked_score(value, name, label) for value, label in zip(values, labels, strict=True)]
    if is_async_reward(reward):
        return _async_scores(reward, name, inputs, labels, timeout)
    values, error, late = _run_items(lambda i: _awaited(reward(inputs[i])), len(inputs), timeout)
    # The scores before a failure first: the first bad sample is the one reported, as if scored one by one.
    scores = [checked_score(value, name, label) for value, label in zip(values, labels)]
    if late is not None:
        raise _timeout_error(name, labels[late], timeout)
    if error is not None:
        i, exc = error
        raise RewardError(f"reward {name!r} failed on {labels[i]}: {type(exc).__name__}: {exc}") from exc
    return scores
