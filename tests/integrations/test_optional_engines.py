"""The core package never imports an optional engine: only its integration module does."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE_ROOT = Path(__file__).resolve().parents[2] / "kvshare"
# module file -> the optional engines it may import
ALLOWED = {"integrations/vllm.py": {"vllm"}}


def engine_imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module.split(".")[0])
    return found & {"vllm", "sglang", "lmcache"}


def test_only_the_integration_modules_import_an_engine() -> None:
    offenders = {
        str(path.relative_to(PACKAGE_ROOT)): imports
        for path in sorted(PACKAGE_ROOT.rglob("*.py"))
        if (
            imports := engine_imports(path)
            - ALLOWED.get(str(path.relative_to(PACKAGE_ROOT)), set())
        )
    }
    assert offenders == {}
    assert engine_imports(PACKAGE_ROOT / "integrations/vllm.py") == {"vllm"}
