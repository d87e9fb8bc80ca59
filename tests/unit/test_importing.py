"""``posttrain.importing.import_object``: resolving ``module:attr`` paths, and errors that name the failing part."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from posttrain.errors import DataError
from posttrain.importing import import_object

MODULE = textwrap.dedent(
    """
    THRESHOLD = 0.5

    def score(sample):
        return 1.0

    class Scorer:
        @staticmethod
        def make():
            return "made"
    """
)


@pytest.fixture
def user_modules(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """``pt_imp_user`` (good), ``pt_imp_broken`` (raises on import), ``pt_imp_needs_dep`` (imports a
    missing package) and the package ``pt_imp_pkg``, importable from a temporary directory."""
    (tmp_path / "pt_imp_user.py").write_text(MODULE)
    (tmp_path / "pt_imp_broken.py").write_text("raise RuntimeError('boom at import')\n")
    (tmp_path / "pt_imp_needs_dep.py").write_text("import pt_imp_not_installed_dep\n")
    pkg = tmp_path / "pt_imp_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "inner.py").write_text("VALUE = 7\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


def test_resolves_module_attribute_dotted_attribute_and_package_module(user_modules: Path) -> None:
    import pt_imp_user  # type: ignore[import-not-found]

    assert import_object("pt_imp_user:score", what="rl.reward") is pt_imp_user.score
    assert import_object("pt_imp_user:THRESHOLD", what="x") == 0.5
    # A dotted attribute walks through the class: the staticmethod itself comes back.
    assert import_object("pt_imp_user:Scorer.make", what="x", must_be_callable=True)() == "made"
    assert import_object("pt_imp_pkg.inner:VALUE", what="x") == 7
    assert import_object("posttrain.errors:DataError", what="x") is DataError


@pytest.mark.parametrize("path", ["pt_imp_user", ":score", "pt_imp_user:", ""])
def test_a_path_without_module_colon_attribute_is_refused(path: str) -> None:
    with pytest.raises(ValueError, match=rf"^rl\.reward: {path!r} is not of the form 'module:function'; write"):
        import_object(path, what="rl.reward")


def test_module_not_found_says_to_check_spelling_or_path(user_modules: Path) -> None:
    with pytest.raises(ValueError) as info:
        import_object("pt_imp_no_such_module:f", what="rl.reward")
    message = str(info.value)
    assert message.startswith("rl.reward: cannot import module 'pt_imp_no_such_module' of 'pt_imp_no_such_module:f': ")
    assert "ModuleNotFoundError" in message
    assert message.endswith("check the spelling, and that the module is installed or its directory is on PYTHONPATH")
    assert isinstance(info.value.__cause__, ModuleNotFoundError)
    # A missing submodule of an existing package is a spelling problem too.
    with pytest.raises(ValueError, match=r"'pt_imp_pkg\.nope'.*check the spelling"):
        import_object("pt_imp_pkg.nope:VALUE", what="x")


def test_a_missing_dependency_and_a_module_that_raises_are_told_apart(user_modules: Path) -> None:
    with pytest.raises(ValueError, match=r"imports 'pt_imp_not_installed_dep', which is not installed; install it$"):
        import_object("pt_imp_needs_dep:f", what="x")
    with pytest.raises(ValueError) as info:
        import_object("pt_imp_broken:f", what="x")
    assert "RuntimeError('boom at import')" in str(info.value)
    assert str(info.value).endswith("the module itself failed while being imported; fix the error above")
    assert isinstance(info.value.__cause__, RuntimeError)


def test_a_missing_attribute_names_the_part_that_failed_and_suggests_a_close_name(user_modules: Path) -> None:
    with pytest.raises(ValueError) as info:
        import_object("pt_imp_user:scroe", what="rl.reward")
    assert str(info.value) == (
        "rl.reward: module 'pt_imp_user' has no attribute 'scroe' (from 'pt_imp_user:scroe'); did you mean 'score'?"
    )
    # In a dotted attribute, the owner shown is the part resolved so far.
    with pytest.raises(ValueError) as info:
        import_object("pt_imp_user:Scorer.mkae", what="x")
    assert str(info.value) == (
        "x: 'pt_imp_user:Scorer' has no attribute 'mkae' (from 'pt_imp_user:Scorer.mkae'); did you mean 'make'?"
    )
    with pytest.raises(ValueError, match=r"has no attribute 'zzzzzz' .*; check the name after the colon$"):
        import_object("pt_imp_user:zzzzzz", what="x")


def test_not_callable_only_when_asked(user_modules: Path) -> None:
    assert import_object("pt_imp_user:THRESHOLD", what="x", must_be_callable=False) == 0.5
    with pytest.raises(ValueError, match=r"^x: 'pt_imp_user:THRESHOLD' is a float, not a function; name a function"):
        import_object("pt_imp_user:THRESHOLD", what="x", must_be_callable=True)


def test_the_error_class_is_the_callers(user_modules: Path) -> None:
    for path in ["no_colon", "pt_imp_no_such_module:f", "pt_imp_user:nope"]:
        with pytest.raises(DataError, match=r"^rl\.data\.factory: "):
            import_object(path, what="rl.data.factory", error=DataError)
    with pytest.raises(DataError, match="is a float, not a function"):
        import_object("pt_imp_user:THRESHOLD", what="rl.data.factory", must_be_callable=True, error=DataError)
