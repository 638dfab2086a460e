"""README's layering holds: ``conf/`` → ``run.py`` → ``experiments/`` → ``kvquant`` → ``kvquant.bits``.

Imports run one way only, checked on the source (nothing is imported): the library never imports
the runners or the entry point, the runners never import the entry point, and ``kvquant.bits``
(the bottom) needs nothing of the library but its error class.
"""

import ast
from pathlib import Path

from conftest import ROOT


def imported(path: Path) -> set[str]:
    """Top-level names of every module ``path`` imports (absolute imports and ``import_module("…")`` literals)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) == "import_module":
            if node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
                names.add(node.args[0].value)
    return names


def offenders(folder: str, forbidden: tuple[str, ...]) -> list[str]:
    return [
        f"{path.relative_to(ROOT)} imports {name}"
        for path in sorted((ROOT / folder).rglob("*.py"))
        for name in sorted(imported(path))
        if name.split(".")[0] in forbidden
    ]


def test_the_library_never_imports_runners_or_the_entry_point():
    assert offenders("kvquant", ("experiments", "run")) == []


def test_runners_never_import_the_entry_point():
    assert offenders("experiments", ("run",)) == []


def test_bits_is_the_bottom_layer():
    library = {name for name in imported(ROOT / "kvquant" / "bits.py") if name.split(".")[0] == "kvquant"}
    assert library <= {"kvquant.errors"}
