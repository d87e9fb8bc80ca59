"""The package's shape, checked from source with ``ast`` (no posttrain module is imported).

Issue 14's structural acceptance: (a) no source file over 500 lines; (b) the layering, low to high,
where a module imports only its own layer or lower ones (module-level and lazy imports alike,
``TYPE_CHECKING`` ones included, and literal ``import_module("posttrain....")`` paths); (c) at most
three branches on the number of processes outside ``posttrain/distributed``, each with a comment
saying why. Each failure lists every offender as ``file:line ...`` so it can be fixed from the message.
"""

from __future__ import annotations

import ast
import io
import re
import sys
import tokenize
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "src" / "posttrain"
MAX_LINES = 500
MAX_PROCESS_BRANCHES = 3

# Low to high. ``__init__`` is the package root (posttrain/__init__.py), which imports nothing.
# Recipes are user-level files that build a config (loaded by name or path, never imported by the
# package): they sit at the top, beside the entry points, and may use only config and models.
LAYERS: list[tuple[str, ...]] = [
    ("__init__", "errors", "importing"),
    ("config", "algorithm"),
    ("models", "metrics", "distributed"),
    ("data", "rewards", "rollout", "policy"),
    ("teacher", "checkpoint"),
    ("preflight",),
    ("loop",),
    ("launch",),
    ("entrypoints", "recipes"),
]
LAYER_OF = {part: rank for rank, parts in enumerate(LAYERS) for part in parts}
# Stricter than the layering: the only posttrain parts these may import besides themselves.
# algorithm is pure math (errors for its exception types); a recipe only builds a config.
ONLY_FROM = {"algorithm": {"errors"}, "recipes": {"config", "models"}}
# algorithm's third-party imports: torch only (plus the standard library).
ALGORITHM_THIRD_PARTY = {"torch"}

# Conditions that branch on "one process or several". Matched against ``ast.unparse`` of the test,
# so spacing is normalised.
PROCESS_COUNT_PATTERNS = [
    r"\.multi\b",
    r"\bmulti\b",
    r"\bis_multi\w*",
    r"\bworld(?:_size)?\s*(?:[<>]=?|[!=]=)\s*\d",
    r"\d\s*(?:[<>]=?|[!=]=)\s*[\w.]*\bworld(?:_size)?\b",
    r"\bworld(?:_size)?\s+(?:not\s+)?in\b",
    r"\bget_world_size\b",
    r"\bdp is (?:not )?None\b",
    r"\bWORLD_SIZE\b",
    r"\benv_world_size\(",
    r"\b(?:dist|distributed)\.is_initialized\(",
    # distributed's own questions, asked from outside it: each answer is a branch on the world
    r"\bwill_shard_policy\(",
    r"\bis_sharded\(",
    r"\brank_and_world\(\)\[1\]",
]
PROCESS_COUNT = re.compile("|".join(PROCESS_COUNT_PATTERNS))


def source_files() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def rel(path: Path) -> str:
    return path.relative_to(REPO).as_posix()


def module_name(path: Path) -> str:
    """``posttrain.loop.run`` for src/posttrain/loop/run.py, ``posttrain.loop`` for its __init__."""
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def part_of(module: str) -> str:
    """The top-level part of ``posttrain.X.Y`` (``X``); ``__init__`` for the package root itself."""
    pieces = module.split(".")
    return pieces[1] if len(pieces) > 1 else "__init__"


def layer_label(part: str) -> str:
    rank = LAYER_OF.get(part)
    return f"layer {rank} ({part})" if rank is not None else f"no layer ({part})"


# ---------------------------------------------------------------- collecting imports


@dataclass(frozen=True)
class Imported:
    line: int
    module: str  # the posttrain module named, e.g. posttrain.data.build (or a third-party top name)


def _resolve_relative(importer: str, is_package: bool, level: int, module: str | None) -> str:
    base = importer.split(".")
    if not is_package:
        base = base[:-1]
    base = base[: len(base) - (level - 1)]
    return ".".join([*base, module] if module else base)


def _literal_module(node: ast.expr) -> str | None:
    """The module a literal ``import_module`` / ``import_object`` argument names (an f-string's
    constant prefix counts: ``f"posttrain.algorithm.{x}"`` names posttrain.algorithm)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value.partition(":")[0]
    if isinstance(node, ast.JoinedStr) and node.values and isinstance(node.values[0], ast.Constant):
        prefix = str(node.values[0].value)
        return prefix.rsplit(".", 1)[0] if "." in prefix else None
    return None


def _from_root(name: str) -> str:
    """``from posttrain import name``: a subpackage or module of the root, else an attribute of the root."""
    is_module = (PACKAGE / name).is_dir() or (PACKAGE / f"{name}.py").is_file()
    return f"posttrain.{name}" if is_module else "posttrain"


def imports_of(source: str, importer: str, *, is_package: bool) -> list[Imported]:
    """Every module ``source`` imports, anywhere in the file, with ``from posttrain import x`` taken
    as importing ``posttrain.x`` and relative imports resolved against ``importer``."""
    found: list[Imported] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [Imported(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _resolve_relative(importer, is_package, node.level, node.module) if node.level else node.module or ""
            if base == "posttrain":
                found += [Imported(node.lineno, _from_root(alias.name)) for alias in node.names]
            else:
                found.append(Imported(node.lineno, base))
        elif isinstance(node, ast.Call) and node.args:
            name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", None)
            if name in {"import_module", "import_object", "__import__"}:
                literal = _literal_module(node.args[0])
                if literal:
                    found.append(Imported(node.lineno, literal))
    return found


# ---------------------------------------------------------------- the rules


def layering_violations(path_label: str, importer: str, imports: list[Imported]) -> list[str]:
    """``file:line imports X (layer a) from layer b`` for every import the layering forbids."""
    own = part_of(importer)
    problems: list[str] = []
    if own not in LAYER_OF:
        return [f"{path_label}:1 is in no layer ({own}); add {own!r} to LAYERS in tests/unit/test_architecture.py"]
    for imp in imports:
        top = imp.module.split(".")[0]
        if top != "posttrain":
            if own == "algorithm" and top not in ALGORITHM_THIRD_PARTY and top not in sys.stdlib_module_names:
                problems.append(f"{path_label}:{imp.line} imports {imp.module} (third-party) from layer 1 (algorithm)")
            continue
        target = part_of(imp.module)
        if target == own:
            continue
        where = f"{path_label}:{imp.line} imports {imp.module} ({layer_label(target)}) from {layer_label(own)}"
        if target not in LAYER_OF:
            problems.append(f"{where}: add {target!r} to LAYERS")
        elif own in ONLY_FROM and target not in ONLY_FROM[own]:
            problems.append(f"{where}: {own} may import only {sorted(ONLY_FROM[own])}")
        elif LAYER_OF[target] > LAYER_OF[own]:
            problems.append(where)
    return problems


def _comment_lines(source: str) -> set[int]:
    tokens = tokenize.generate_tokens(io.StringIO(source).readline)
    return {tok.start[0] for tok in tokens if tok.type == tokenize.COMMENT}


def process_count_branches(source: str) -> list[tuple[int, str, bool]]:
    """``(line, condition, has_comment)`` for every if / elif / while / ternary / comprehension
    condition that asks how many processes there are; the comment may sit on the line before the
    branch or on any line from the branch to the end of its condition."""
    comments = _comment_lines(source)
    found: list[tuple[int, str, bool]] = []
    for node in ast.walk(ast.parse(source)):
        tests: list[ast.expr] = []
        if isinstance(node, (ast.If, ast.While, ast.IfExp)):
            tests = [node.test]
        elif isinstance(node, ast.comprehension):
            tests = list(node.ifs)
        for test in tests:
            condition = ast.unparse(test)
            if PROCESS_COUNT.search(condition):
                start = getattr(node, "lineno", test.lineno)
                end = test.end_lineno or test.lineno
                explained = any(line in comments for line in range(start - 1, end + 1))
                found.append((start, condition, explained))
    return sorted(found)


# ---------------------------------------------------------------- the checks on the package


def test_no_source_file_is_over_500_lines() -> None:
    long = [f"{rel(p)}: {n} lines" for p in source_files() if (n := len(p.read_text().splitlines())) > MAX_LINES]
    assert not long, f"split these by job (at most {MAX_LINES} lines each):\n" + "\n".join(long)


def test_no_module_imports_a_higher_layer() -> None:
    problems: list[str] = []
    for path in source_files():
        importer = module_name(path)
        imports = imports_of(path.read_text(), importer, is_package=path.name == "__init__.py")
        problems += layering_violations(rel(path), importer, imports)
    order = " < ".join(", ".join(parts) for parts in LAYERS)
    assert not problems, (
        f"{len(problems)} import(s) break the layering ({order}; recipes only config and models, algorithm only "
        "errors, torch and the standard library):\n" + "\n".join(problems)
    )


def test_at_most_three_commented_branches_on_the_process_count_outside_distributed() -> None:
    branches: list[str] = []
    unexplained: list[str] = []
    for path in source_files():
        if path.is_relative_to(PACKAGE / "distributed"):
            continue
        for line, condition, explained in process_count_branches(path.read_text()):
            branches.append(f"{rel(path)}:{line}: {condition}")
            if not explained:
                unexplained.append(f"{rel(path)}:{line}: {condition}")
    listing = "\n".join(branches)
    assert len(branches) <= MAX_PROCESS_BRANCHES, (
        f"{len(branches)} branches on the number of processes outside posttrain/distributed (at most "
        f"{MAX_PROCESS_BRANCHES}); let the distributed world's size-1 case be trivial instead:\n{listing}"
    )
    assert not unexplained, "say why in a comment on or above each of these branches:\n" + "\n".join(unexplained)


# ---------------------------------------------------------------- the checkers themselves


def test_imports_are_found_everywhere_and_resolved() -> None:
    source = (
        "import torch\n"
        "from posttrain.config.schema import GRPOConfig\n"
        "from posttrain import errors, loop, __version__\n"
        "from . import sibling\n"
        "from ..rollout.base import RolloutEngine\n"
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n"
        "    from posttrain.teacher.base import Teacher\n"
        "def lazy():\n"
        "    import posttrain.launch.ray_backend\n"
        "    importlib.import_module('posttrain.checkpoint.writer')\n"
        "    import_object('posttrain.loop.grpo:train', what='x')\n"
        "    importlib.import_module(f'posttrain.metrics.{name}')\n"
    )
    found = imports_of(source, "posttrain.policy.trainer", is_package=False)
    assert [(i.line, i.module) for i in found if i.module.startswith("posttrain")] == [
        (2, "posttrain.config.schema"),
        (3, "posttrain.errors"),
        (3, "posttrain.loop"),
        (3, "posttrain"),
        (4, "posttrain.policy"),
        (5, "posttrain.rollout.base"),
        (8, "posttrain.teacher.base"),
        (10, "posttrain.launch.ray_backend"),
        (11, "posttrain.checkpoint.writer"),
        (12, "posttrain.loop.grpo"),
        (13, "posttrain.metrics"),
    ]
    # In a package's __init__, "from . import x" is relative to the package itself.
    assert imports_of("from .cells import Cells\n", "posttrain.distributed", is_package=True) == [
        Imported(1, "posttrain.distributed.cells")
    ]


def test_layering_rules_read_as_file_line_layer() -> None:
    imports = [
        Imported(3, "posttrain.errors"),
        Imported(4, "posttrain.config.schema"),
        Imported(5, "posttrain.rollout.base"),
        Imported(6, "posttrain.loop.run"),
        Imported(7, "posttrain.widgets"),
    ]
    assert layering_violations("src/posttrain/policy/trainer.py", "posttrain.policy.trainer", imports) == [
        "src/posttrain/policy/trainer.py:6 imports posttrain.loop.run (layer 6 (loop)) from layer 3 (policy)",
        "src/posttrain/policy/trainer.py:7 imports posttrain.widgets (no layer (widgets)) from layer 3 (policy): "
        "add 'widgets' to LAYERS",
    ]
    # config may not import data/rewards/policy/loop; recipes only config and models; algorithm only errors,
    # torch and the standard library (algorithm and config share a layer, yet algorithm may not
    # import config).
    assert layering_violations("c.py", "posttrain.config.validate", [Imported(1, "posttrain.data.build")]) == [
        "c.py:1 imports posttrain.data.build (layer 3 (data)) from layer 1 (config)"
    ]
    recipe = [Imported(1, "posttrain.config.schema"), Imported(2, "posttrain.models.opd_demo")]
    assert layering_violations("r.py", "posttrain.recipes.opd", recipe) == []
    recipe.append(Imported(3, "posttrain.loop.grpo"))
    assert layering_violations("r.py", "posttrain.recipes.opd", recipe) == [
        "r.py:3 imports posttrain.loop.grpo (layer 6 (loop)) from layer 8 (recipes): "
        "recipes may import only ['config', 'models']"
    ]
    algo = [Imported(1, "math"), Imported(2, "torch"), Imported(3, "numpy"), Imported(4, "posttrain.config")]
    assert layering_violations("a.py", "posttrain.algorithm.kl", algo) == [
        "a.py:3 imports numpy (third-party) from layer 1 (algorithm)",
        "a.py:4 imports posttrain.config (layer 1 (config)) from layer 1 (algorithm): algorithm may import only "
        "['errors']",
    ]


def test_process_count_branches_are_found_with_their_comments() -> None:
    source = (
        "def f(cells, world, self, dist, os):\n"
        "    # the driver alone writes the manifest\n"
        "    if cells.multi:\n"
        "        pass\n"
        "    elif world>1:  # one rank: nothing to gather\n"
        "        pass\n"
        "    x = 1 if self.dp is None else 2\n"
        "    while dist.get_world_size() == 1:\n"
        "        pass\n"
        "    y = [r for r in range(3) if 1 < world]\n"
        "    if os.environ.get('WORLD_SIZE'):\n"
        "        pass\n"
        "    if self.rank == 0 or worldly > 1 or is_rank_zero() or torch.cuda.is_initialized():\n"
        "        pass\n"
        "    tag = 'r' if world not in ('', '1') else ''  # torchrun's WORLD_SIZE, a string\n"
    )
    assert process_count_branches(source) == [
        (3, "cells.multi", True),
        (5, "world > 1", True),
        (7, "self.dp is None", False),
        (8, "dist.get_world_size() == 1", False),
        (10, "1 < world", False),
        (11, "os.environ.get('WORLD_SIZE')", False),
        (15, "world not in ('', '1')", True),
    ]
