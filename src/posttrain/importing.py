"""Resolve a ``package.module:attr`` import path to the object it names, with errors that say what to change.

Recipes name user code (a custom reward, a prompt factory) and the launcher names the loop and the
config class by such paths. Every caller goes through ``import_object`` so that a typo reads the same
everywhere: the message names the setting (``what``), the path, the part that failed (the module
cannot be imported, an attribute is missing, the object is not callable) and what to change.
"""

from __future__ import annotations

import difflib
import importlib
from collections.abc import Callable
from typing import Any

_FORM = "'module:function'"


def import_object(
    path: str,
    *,
    what: str,
    must_be_callable: bool = False,
    error: Callable[[str], Exception] = ValueError,
) -> Any:
    """The object ``path`` names: ``"package.module:attr"``, where ``attr`` may be dotted (``Class.method``).

    ``what`` names the setting in errors (``"rl.reward"``); ``must_be_callable`` refuses an object that
    cannot be called; ``error`` builds the exception raised (``ValueError`` by default; pass the class
    the caller's users expect, e.g. ``DataError``). Any failure while importing the module, including an
    exception raised by the user's module itself, becomes such an error with the cause chained.
    """
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise error(
            f"{what}: {path!r} is not of the form {_FORM}; write the importable module, a colon, "
            "then the attribute, e.g. 'my_package.my_module:my_function'"
        )
    obj = _import_module(module_name, path, what, error)
    walked = module_name
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise error(_missing_attribute(obj, part, walked, path, what))
        obj = getattr(obj, part)
        walked = f"{walked}{'.' if ':' in walked else ':'}{part}"
    if must_be_callable and not callable(obj):
        raise error(f"{what}: {path!r} is a {type(obj).__name__}, not a function; name a function or class instead")
    return obj


def _import_module(module_name: str, path: str, what: str, error: Callable[[str], Exception]) -> Any:
    try:
        return importlib.import_module(module_name)
    except Exception as exc:  # any failure while importing user code is a config problem to report
        raise error(
            f"{what}: cannot import module {module_name!r} of {path!r}: {exc!r}; {_import_hint(module_name, exc)}"
        ) from exc


def _import_hint(module_name: str, exc: Exception) -> str:
    missing = getattr(exc, "name", None) if isinstance(exc, ModuleNotFoundError) else None
    if missing is not None and (module_name == missing or module_name.startswith(f"{missing}.")):
        return "check the spelling, and that the module is installed or its directory is on PYTHONPATH"
    if missing is not None:
        return f"the module imports {missing!r}, which is not installed; install it"
    return "the module itself failed while being imported; fix the error above"


def _missing_attribute(obj: Any, part: str, walked: str, path: str, what: str) -> str:
    owner = f"module {walked!r}" if ":" not in walked else repr(walked)
    close = difflib.get_close_matches(part, [n for n in dir(obj) if not n.startswith("_")], n=1)
    hint = f"did you mean {close[0]!r}?" if close else "check the name after the colon"
    return f"{what}: {owner} has no attribute {part!r} (from {path!r}); {hint}"
