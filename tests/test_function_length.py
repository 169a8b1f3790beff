"""No function in src/pagedserve is over MAX_LINES lines, counted from its `def` to its
last line (docstring and nested functions included), unless its docstring has a
paragraph that starts with EXEMPT and says why (a Triton kernel that is one compiled
program, say); a reason of fewer than MIN_REASON_WORDS words does not count."""
from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "src" / "pagedserve"
MAX_LINES = 80
EXEMPT = f"Over {MAX_LINES} lines because"
MIN_REASON_WORDS = 8


def states_a_reason(paragraph: str) -> bool:
    """Whether paragraph starts with EXEMPT and goes on for at least MIN_REASON_WORDS words
    (tests/test_function_length_cpp.py asks the same of a C++ function's comment)."""
    return paragraph.startswith(EXEMPT) and len(paragraph[len(EXEMPT):].split()) >= MIN_REASON_WORDS


def justified(function: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    return any(states_a_reason(paragraph) for paragraph in (ast.get_docstring(function) or "").split("\n\n"))


def long_functions(root: Path) -> list[str]:
    """`path:line name (N lines)` for every function over MAX_LINES lines without a reason."""
    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > MAX_LINES and not justified(node):
                    found.append(f"{path.relative_to(root.parent)}:{node.lineno} {node.name} ({length} lines)")
    return found


def test_no_function_is_over_the_limit_without_a_reason():
    assert not long_functions(SRC), (f"functions over {MAX_LINES} lines (split them, or say why in a docstring "
                                     f"paragraph starting {EXEMPT!r}):\n" + "\n".join(long_functions(SRC)))


def test_the_check_sees_a_long_function_and_a_reason(tmp_path: Path):
    root = tmp_path / "pagedserve"
    root.mkdir()
    body = "    x = 1\n" * MAX_LINES
    (root / "m.py").write_text(f"def short():\n    pass\n\n\ndef long():\n{body}")
    assert long_functions(root) == [f"pagedserve/m.py:5 long ({MAX_LINES + 1} lines)"]
    reason = f'    """Does one thing.\n\n    {EXEMPT} it is one compiled program with many parameters."""\n'
    (root / "m.py").write_text(f"def long():\n{reason}{body}")
    assert long_functions(root) == []
    (root / "m.py").write_text(f'def long():\n    """{EXEMPT} it is."""\n{body}')
    assert long_functions(root) == [f"pagedserve/m.py:1 long ({MAX_LINES + 2} lines)"]
