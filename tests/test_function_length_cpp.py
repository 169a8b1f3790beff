"""The function-length rule of tests/test_function_length.py for the native op library:
no C++ function in src/pagedserve/kernels/csrc is over MAX_LINES lines, counted from the
first line of its definition (a `template <...>` line included) to its closing brace,
unless the comment directly above the definition has a paragraph that starts with
EXEMPT and gives a reason of at least MIN_REASON_WORDS words.

The scan is a small C++ reader, not a compiler: it blanks comments, string and char
literals and preprocessor lines, then walks the declarations of each namespace, class
and `extern` block, and takes a `{` whose declaration has a parameter list (and no `=`
before it) as a function body, matched to its `}` by counting braces."""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from test_function_length import EXEMPT, MAX_LINES, SRC, states_a_reason

CSRC = SRC / "kernels" / "csrc"
SUFFIXES = (".cpp", ".cc", ".h", ".hpp", ".inc")
TOKEN = re.compile(r"[A-Za-z_]\w*|\d[\w.']*|::|\S")
# Groups in a declaration that hold parentheses but are no parameter list.
NOT_PARAMETERS = {"__attribute__", "__declspec", "alignas", "decltype", "sizeof", "alignof"}
SCOPES = {"namespace", "class", "struct", "union"}
ACCESS = {"public", "private", "protected"}
RAW_PREFIXES = {"R", "u8R", "uR", "UR", "LR"}


@dataclass(frozen=True)
class Token:
    text: str
    line: int


@dataclass(frozen=True)
class Function:
    name: str
    first_line: int
    last_line: int

    @property
    def length(self) -> int:
        return self.last_line - self.first_line + 1


def _literal_end(text: str, i: int) -> int:
    """The index just past the string or char literal whose opening quote is text[i]."""
    quote = text[i]
    prefix = re.search(r"\w*$", text[max(0, i - 3):i]).group()
    if quote == '"' and prefix in RAW_PREFIXES:
        delimiter = text[i + 1:text.index("(", i)]
        return text.index(f"){delimiter}\"", i) + len(delimiter) + 2
    j = i + 1
    while j < len(text) and text[j] != quote and text[j] != "\n":
        j += 2 if text[j] == "\\" else 1
    return j + 1


def code_only(text: str) -> str:
    """text with every comment, string and char literal and preprocessor directive turned
    into spaces, newlines kept, so that what is left of the braces is the code's."""
    out = list(text)
    i, directive, line_start = 0, False, True

    def blank(start: int, end: int) -> None:
        for k in range(start, min(end, len(text))):
            if out[k] != "\n":
                out[k] = " "

    while i < len(text):
        c, pair = text[i], text[i:i + 2]
        if c == "\n":
            directive = directive and i > 0 and text[i - 1] == "\\"
            line_start, i = True, i + 1
            continue
        if pair == "//":
            end = text.find("\n", i)
            end = len(text) if end < 0 else end
        elif pair == "/*":
            end = text.index("*/", i + 2) + 2
        elif c == '"' or (c == "'" and not re.search(r"\b\d[\w.']*$", text[max(0, i - 40):i])):
            end = _literal_end(text, i)
        else:
            if c == "#" and line_start:
                directive = True
            if directive:
                blank(i, i + 1)
            line_start = line_start and c.isspace()
            i += 1
            continue
        blank(i, end)
        line_start, i = False, end
    return "".join(out)


def tokens(code: str) -> list[Token]:
    found, line, pos = [], 1, 0
    for match in TOKEN.finditer(code):
        line += code.count("\n", pos, match.start())
        pos = match.start()
        found.append(Token(match.group(), line))
    return found


def matching(toks: list[Token], i: int) -> int:
    """The index of the bracket that closes toks[i] (an opening `{`, `(`, `[` or `<`)."""
    close = {"{": "}", "(": ")", "[": "]", "<": ">"}[toks[i].text]
    depth = 0
    for j in range(i, len(toks)):
        depth += (toks[j].text == toks[i].text) - (toks[j].text == close)
        if depth == 0:
            return j
    raise ValueError(f"line {toks[i].line}: {toks[i].text!r} is never closed")


def _without_decorations(head: list[Token]) -> list[Token]:
    """head less its `template <...>` headers, attributes and the groups in NOT_PARAMETERS."""
    kept, i = [], 0
    while i < len(head):
        text = head[i].text
        if text == "template" and i + 1 < len(head) and head[i + 1].text == "<":
            i = matching(head, i + 1) + 1
        elif text in NOT_PARAMETERS and i + 1 < len(head) and head[i + 1].text == "(":
            i = matching(head, i + 1) + 1
        elif text == "[" and i + 1 < len(head) and head[i + 1].text == "[":
            i = matching(head, i) + 1
        else:
            kept.append(head[i])
            i += 1
    return kept


def _parameters(head: list[Token]) -> int | None:
    """The index in head of the `(` that opens a function's parameters, or None where the
    declaration is no function (a variable's initializer, a class, an enum)."""
    for i, token in enumerate(head):
        if token.text in SCOPES | {"enum", "="}:
            return None
        if token.text == "(":
            return i + 1 if i > 0 and head[i - 1].text == "operator" else i
    return None


def _name(head: list[Token], paren: int) -> str:
    """The function's name as written before its parameters: `f`, `Row::grow`, `~Row`,
    `operator()`."""
    start = paren - 1
    operators = [k for k, t in enumerate(head[:paren]) if t.text == "operator"]
    if operators:
        start = operators[-1]
    while start > 0 and head[start - 1].text == "~":
        start -= 1
    while start > 1 and head[start - 1].text == "::" and re.fullmatch(r"\w+", head[start - 2].text):
        start -= 2
    return "".join(t.text for t in head[start:paren])


def _body_opens_here(head: list[Token], paren: int) -> bool:
    """Whether a `{` after head opens the body rather than one member's brace
    initializer in a constructor's `: a_(x), b_{y}` list."""
    close = matching(head, paren)
    in_initializers = any(t.text == ":" for t in head[close + 1:])
    return not in_initializers or head[-1].text in (")", "}")


def functions(code: str) -> list[Function]:
    """Each function definition in code (already code_only), nested ones left out."""
    toks, found, head, i = tokens(code), [], [], 0
    while i < len(toks):
        text = toks[i].text
        if text in (";", "}") or (text == ":" and len(head) == 1 and head[0].text in ACCESS):
            head, i = [], i + 1
            continue
        if text != "{":
            head.append(toks[i])
            i += 1
            continue
        end = matching(toks, i)
        plain = _without_decorations(head)
        paren = _parameters(plain)
        words = {t.text for t in plain}
        open_parens = sum(t.text == "(" for t in head) - sum(t.text == ")" for t in head)
        if open_parens == 0 and paren is not None and _body_opens_here(plain, paren):
            found.append(Function(_name(plain, paren), head[0].line, toks[end].line))
            head = []
        elif open_parens == 0 and (SCOPES | {"extern"}) & words and not {
                "enum", "="} & words:
            head, end = [], i  # a namespace, class or extern block: its declarations are read in turn
        else:
            head += [toks[i], toks[end]]  # an initializer's braces: the declaration goes on to its `;`
        i = end + 1
    return found


def comment_above(lines: list[str], line: int) -> str:
    """The `//` or `/* */` comment that ends on the line just above line (1-based), its
    markers removed and its paragraphs separated by blank lines."""
    above, k, in_block = [], line - 2, False
    while k >= 0:
        stripped = lines[k].strip()
        if stripped.endswith("*/"):
            in_block = True
        if not (in_block or stripped.startswith("//")):
            break
        if stripped.startswith("/*"):
            in_block = False
        above.append(re.sub(r"^(/\*+|//+|\*+(?!/))|\*/$", "", stripped).strip())
        k -= 1
    return "\n".join(reversed(above))


def justified(lines: list[str], function: Function) -> bool:
    paragraphs = re.split(r"\n\s*\n", comment_above(lines, function.first_line))
    return any(states_a_reason(" ".join(p.split())) for p in paragraphs)


def long_functions(root: Path) -> list[str]:
    """`path:line name (N lines)` for every C++ function over MAX_LINES lines without a reason."""
    found = []
    for path in sorted(p for p in root.rglob("*") if p.suffix in SUFFIXES):
        text = path.read_text()
        lines = text.splitlines()
        for function in functions(code_only(text)):
            if function.length > MAX_LINES and not justified(lines, function):
                found.append(f"{path.relative_to(root.parent)}:{function.first_line} {function.name} "
                             f"({function.length} lines)")
    return found


def test_no_cpp_function_is_over_the_limit_without_a_reason():
    assert CSRC.is_dir() and any(CSRC.glob("*.cpp"))
    assert not long_functions(CSRC), (f"C++ functions over {MAX_LINES} lines (split them, or say why in a "
                                      f"comment paragraph above them starting {EXEMPT!r}):\n"
                                      + "\n".join(long_functions(CSRC)))


def test_the_scan_finds_every_kind_of_definition():
    code = code_only(
        '#include <vector>\n'                                        # 1
        '#define BRACE {\n'                                          # 2
        'namespace ps {\n'                                           # 3
        'constexpr int kTable[2] = {1, 2};\n'                        # 4
        'template <typename T, int N = sizeof(T)>\n'                 # 5
        '__attribute__((target("avx2"))) T twice(T x) {\n'          # 6
        '  const char* s = "}}{"; char c = \'}\'; // }\n'            # 7
        '  /* { */ return x * 2 + 1\'000;\n'                         # 8
        '}\n'                                                        # 9
        'struct Row : Base {\n'                                      # 10
        ' public:\n'                                                 # 11
        '  Row(int n) : n_(n), v_{n, 2} { if (n) { n_ = 1; } }\n'    # 12
        '  int size() const { return n_; }\n'                        # 13
        '  int n_; std::vector<int> v_;\n'                           # 14
        '};\n'                                                       # 15
        'auto lambda = [](int a) { return a; };\n'                   # 16
        'void Row::grow(int by = {}) noexcept {\n'                   # 17
        '  auto f = [&] { return R"x(})x"; };\n'                     # 18
        '}\n'                                                        # 19
        '}  // namespace ps\n'                                       # 20
        'extern "C" { int c_entry(void) { return 0; } }\n'           # 21
        'TORCH_LIBRARY_FRAGMENT(ps, m) {\n'                          # 22
        '  m.def("f");\n'                                            # 23
        '}\n')                                                       # 24
    assert functions(code) == [Function("twice", 5, 9), Function("Row", 12, 12), Function("size", 13, 13),
                               Function("Row::grow", 17, 19), Function("c_entry", 21, 21),
                               Function("TORCH_LIBRARY_FRAGMENT", 22, 24)]


def test_the_check_sees_a_long_function_and_a_reason(tmp_path: Path):
    root = tmp_path / "csrc"
    root.mkdir()
    body = '  x += 1;  // a "}" in a comment\n' * MAX_LINES
    long = f"void long_one(int& x) {{\n{body}}}\n"
    (root / "k.cpp").write_text(f"inline int short_one() {{ return 1; }}\n\n{long}")
    assert long_functions(root) == [f"csrc/k.cpp:3 long_one ({MAX_LINES + 2} lines)"]
    reason = f"// Adds one.\n//\n// {EXEMPT} its loop is one unrolled pipeline that\n// a split would break.\n"
    (root / "k.cpp").write_text(f"{reason}{long}")
    assert long_functions(root) == []
    (root / "k.cpp").write_text(f"/* {EXEMPT} its loop is one unrolled pipeline that\n * a split would break. */\n{long}")
    assert long_functions(root) == []
    (root / "k.cpp").write_text(f"// {EXEMPT} it is.\n{long}")
    assert long_functions(root) == [f"csrc/k.cpp:2 long_one ({MAX_LINES + 2} lines)"]
    (root / "k.cpp").write_text(f"{reason}\n{long}")  # a blank line: the comment is not the function's
    assert long_functions(root) == [f"csrc/k.cpp:6 long_one ({MAX_LINES + 2} lines)"]
    (root / "k.h").write_text(f"template <int N>\n{long}")
    assert long_functions(root) == [f"csrc/k.cpp:6 long_one ({MAX_LINES + 2} lines)",
                                    f"csrc/k.h:1 long_one ({MAX_LINES + 3} lines)"]
