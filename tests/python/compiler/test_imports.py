"""Imports run one way: compiler_passes knows nothing of the engine, runtime or server; the only
mlc_lora modules it uses are the shared contract and errors. It is installed as
mlc_lora.compiler_passes through the python/mlc_lora/compiler_passes symlink."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
PACKAGE = ROOT / "compiler_passes"
ALLOWED = {"mlc_lora.contract", "mlc_lora.errors"}


def _imports(path: Path):
    """(module, relative level) of every import in `path`."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            yield from ((alias.name, 0) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            yield node.module or "", node.level


def test_compiler_passes_imports_only_the_contract_of_mlc_lora():
    files = sorted(PACKAGE.rglob("*.py"))
    assert len(files) > 20
    for path in files:
        depth = len(path.relative_to(PACKAGE).parts) - 1  # packages above the file inside compiler_passes
        for module, level in _imports(path):
            where = f"{path.relative_to(ROOT)} imports {'.' * level}{module}"
            assert level <= depth + 1, where  # a relative import stays inside compiler_passes
            if level == 0 and module.split(".")[0] == "mlc_lora":
                assert module in ALLOWED, where


def test_the_package_is_found_under_python_mlc_lora():
    link = ROOT / "python" / "mlc_lora" / "compiler_passes"
    assert link.is_symlink() and link.resolve() == PACKAGE.resolve()
    import mlc_lora.compiler_passes

    assert Path(mlc_lora.compiler_passes.__file__).resolve() == PACKAGE / "__init__.py"
