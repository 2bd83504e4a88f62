#!/usr/bin/env python3
"""Checks the size limits of the C++ and CUDA sources: no file over MAX_FILE_LINES
lines, no function over MAX_FUNCTION_LINES lines.

Usage: tools/check_sizes.py [--root DIR] [--self-test]

The files are the repository's *.cpp, *.h and *.cu (tracked, or new and not
ignored), tests included. A function is measured from the first line of its
signature to its closing brace. Functions are found by brace matching over
the source with comments, string and character literals and preprocessor
lines blanked out; a brace opens a function body when what precedes it (back
to the previous ';', '{' or '}' at the same level) is a signature: it ends in
')' (then const, noexcept, override, a trailing return type...) or in a
constructor's initializer list. Lambdas, local classes and blocks count
towards the function that holds them; methods defined in a class body count
on their own.

Exit status: 0 when every violation is in ALLOWED below, 1 otherwise.
"""
import argparse
import os
import re
import subprocess
import sys

MAX_FILE_LINES = 1000
MAX_FUNCTION_LINES = 150

# Files still being split. Their violations are reported but do not fail the
# check; an entry goes away when its file is within the limits.
ALLOWED = set()

EXTENSIONS = (".cpp", ".h", ".cu")


def blank(text):
    """Returns text with comments, string and character literals and
    preprocessor lines replaced by spaces; newlines are kept, so offsets and
    line numbers stay those of the original."""
    out = list(text)
    n = len(text)
    i = 0
    at_line_start = True  # only whitespace since the last newline

    def clear(a, b):
        for k in range(a, b):
            if out[k] != "\n":
                out[k] = " "

    while i < n:
        c = text[i]
        if c == "\n":
            at_line_start = True
            i += 1
            continue
        if c in " \t\r\f\v":
            i += 1
            continue
        if at_line_start and c == "#":
            # A preprocessor line, with its continuations.
            j = i
            while j < n and text[j] != "\n":
                if text[j] == "\\" and j + 1 < n and text[j + 1] == "\n":
                    j += 2
                    continue
                if text.startswith("/*", j):
                    end = text.find("*/", j + 2)
                    j = n if end < 0 else end + 2
                    continue
                if text.startswith("//", j):
                    while j < n and text[j] != "\n":
                        j += 1
                    break
                j += 1
            clear(i, j)
            i = j
            continue
        at_line_start = False
        if text.startswith("//", i):
            j = text.find("\n", i)
            j = n if j < 0 else j
            clear(i, j)
            i = j
            continue
        if text.startswith("/*", i):
            j = text.find("*/", i + 2)
            j = n if j < 0 else j + 2
            clear(i, j)
            i = j
            continue
        m = re.compile(r'(?:u8|u|U|L)?R"([^()\\\s]{0,16})\(').match(text, i)
        if m and (i == 0 or not (text[i - 1].isalnum() or text[i - 1] == "_")):
            end = text.find(")" + m.group(1) + '"', m.end())
            j = n if end < 0 else end + len(m.group(1)) + 2
            clear(i, j)
            i = j
            continue
        if c == '"' or (c == "'" and not (i > 0 and text[i - 1].isalnum())):
            # A literal; a quote after a digit or letter is a digit separator
            # (1'000) and not a character literal.
            j = i + 1
            while j < n and text[j] != c and text[j] != "\n":
                j += 2 if text[j] == "\\" else 1
            j = min(j + 1, n)
            clear(i, j)
            i = j
            continue
        i += 1
    return "".join(out)


CONTROL = re.compile(r"^(if|for|while|switch|catch|do|else|try|return)\b")
ACCESS = re.compile(r"^(?:(?:public|private|protected)\s*:(?!:)\s*)+")
TEMPLATE = re.compile(r"^template\s*<")
TYPE_HEAD = re.compile(r"^(?:typedef\s+)?(?:class|struct|union|enum)\b")
QUALIFIERS = re.compile(
    r"(?:\s*(?:const|volatile|noexcept(?:\s*\([^()]*\))?|override|final|mutable|&&|&|"
    r"throw\s*\(\s*\)|try|__device__|__host__))*\s*$"
)
TRAILING_RETURN = re.compile(r"->\s*[\w:<>,\s*&]+$")
CLASS_TAIL = re.compile(r"(?:^|[\s)])(?:class|struct|union)\s+\w+(?:\s+final)?(?:\s*:[^(){};]*)?$")
CTOR_INIT = re.compile(r"\)\s*(?:noexcept\s*)?:(?!:)")


def strip_template(head):
    """Drops a leading template<...> (nested angle brackets included)."""
    while TEMPLATE.match(head):
        depth = 0
        for k in range(head.index("<"), len(head)):
            if head[k] == "<":
                depth += 1
            elif head[k] == ">":
                depth -= 1
                if depth == 0:
                    head = head[k + 1 :].lstrip()
                    break
        else:
            return head
    return head


def outside_parens(text):
    """text without what parentheses enclose."""
    out, depth = [], 0
    for ch in text:
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth = max(0, depth - 1)
        elif depth == 0:
            out.append(ch)
    return "".join(out)


def classify(head):
    """What a '{' opens, given the text before it: 'namespace', 'class',
    'function', 'init' (a member's brace initializer inside a constructor's
    initializer list; the head continues after it) or 'other'."""
    head = ACCESS.sub("", head.strip())
    head = strip_template(head)
    if not head:
        return "other"
    if re.match(r"^(?:inline\s+)?namespace\b", head) or re.match(r'^extern\s*"\s*"$', head):
        return "namespace"
    if re.match(r'^extern\s*"', head):
        return "namespace"
    if CONTROL.match(head):
        return "other"
    if TYPE_HEAD.match(head) and "(" not in head.split("{")[0].split(":")[0]:
        return "class"
    if CLASS_TAIL.search(head):
        return "class"  # after macro invocations that end without ';'
    if CTOR_INIT.search(head) and not TYPE_HEAD.match(head):
        # Inside an initializer list: "x{...}" initializes a member; the body
        # follows ')' or '}'.
        if re.search(r"[\w>]\s*$", head):
            return "init"
        return "function"
    if "=" in outside_parens(re.sub(r"operator\s*\S+?\s*\(", "operator(", head)):
        return "other"  # an initializer (default arguments are inside parentheses)
    stripped = QUALIFIERS.sub("", head)
    stripped = TRAILING_RETURN.sub("", stripped).rstrip()
    stripped = QUALIFIERS.sub("", stripped)
    if stripped.endswith(")") and "(" in stripped:
        if re.search(r"\]\s*\([^()]*\)$", stripped) or stripped.startswith("["):
            return "other"  # a lambda outside a function
        return "function"
    return "other"


def skip_braces(clean, i):
    """The offset after the '}' that closes the '{' at clean[i]."""
    depth = 0
    for j in range(i, len(clean)):
        if clean[j] == "{":
            depth += 1
        elif clean[j] == "}":
            depth -= 1
            if depth == 0:
                return j + 1
    return len(clean)


def functions(text):
    """Yields (first line, last line, name) of each function in text (C++),
    lines counted from 1."""
    clean = blank(text)
    line_starts = [0]
    for k, ch in enumerate(clean):
        if ch == "\n":
            line_starts.append(k + 1)

    def line_of(offset):
        lo, hi = 0, len(line_starts) - 1
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if line_starts[mid] <= offset:
                lo = mid
            else:
                hi = mid - 1
        return lo + 1

    # A stack of open scopes: (kind, head start); heads start after the last
    # ';', '{' or '}' of the enclosing scope.
    stack = []
    head_start = 0
    depth_in_function = 0
    function_start = None
    function_name = ""
    i = 0
    n = len(clean)
    paren = 0
    while i < n:
        c = clean[i]
        if depth_in_function:
            if c == "{":
                depth_in_function += 1
            elif c == "}":
                depth_in_function -= 1
                if depth_in_function == 0:
                    yield (function_start, line_of(i), function_name)
                    head_start = i + 1
            i += 1
            continue
        if c == "{" and paren:
            # A braced initializer inside parentheses (a default argument, a
            # lambda passed to a macro): part of the declaration.
            i = skip_braces(clean, i)
            continue
        if c == "(":
            paren += 1
        elif c == ")":
            paren = max(0, paren - 1)
        elif c == ";" and paren == 0:
            head_start = i + 1
        elif c == "{":
            head = clean[head_start:i]
            kind = classify(head)
            if kind == "function":
                first = head_start + (len(head) - len(head.lstrip()))
                first += len(head.lstrip()) - len(ACCESS.sub("", head.lstrip()))
                function_start = line_of(first)
                name = re.sub(r"\s+", " ", head.strip())
                m = re.search(r"([\w:~<>]+|operator\s*\S+)\s*\(", strip_template(ACCESS.sub("", name)))
                function_name = m.group(1) if m else name[:60]
                depth_in_function = 1
                paren = 0
            elif kind == "init":
                # Skip the member initializer; the head goes on.
                i = skip_braces(clean, i)
                continue
            elif kind in ("namespace", "class"):
                stack.append(kind)
                head_start = i + 1
            else:
                # An initializer, an enum or a lambda at namespace scope:
                # skip to its end; what follows it continues the declaration.
                i = skip_braces(clean, i)
                continue
        elif c == "}":
            if stack:
                stack.pop()
            head_start = i + 1
            paren = 0
        i += 1


def source_files(root):
    try:
        listed = subprocess.run(
            ["git", "-C", root, "ls-files", "--cached", "--others", "--exclude-standard"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout.splitlines()
    except (OSError, subprocess.CalledProcessError):
        listed = []
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames[:] = [d for d in dirnames if not d.startswith(".") and not d.startswith("build")]
            for f in filenames:
                listed.append(os.path.relpath(os.path.join(dirpath, f), root))
    return sorted(
        {p for p in listed if p.endswith(EXTENSIONS) and os.path.isfile(os.path.join(root, p))}
    )


def check(root):
    violations = {}  # path -> [text]
    for path in source_files(root):
        with open(os.path.join(root, path), encoding="utf-8", errors="replace") as f:
            text = f.read()
        found = []
        lines = len(text.splitlines())
        if lines > MAX_FILE_LINES:
            found.append(f"{path}: {lines} lines (limit {MAX_FILE_LINES})")
        for first, last, name in functions(text):
            length = last - first + 1
            if length > MAX_FUNCTION_LINES:
                found.append(
                    f"{path}:{first}: function {name} has {length} lines (limit {MAX_FUNCTION_LINES})"
                )
        if found:
            violations[path] = found
    failing = [v for p, vs in violations.items() if p not in ALLOWED for v in vs]
    excused = [v for p, vs in violations.items() if p in ALLOWED for v in vs]
    stale = sorted(p for p in ALLOWED if p not in violations)
    for v in failing:
        print(v)
    if excused:
        print(f"allowed for now ({len(ALLOWED)} files being split):")
        for v in excused:
            print("  " + v)
    for p in stale:
        print(f"{p} is within the limits: take it off the allow-list in tools/check_sizes.py")
    if failing:
        print(f"{len(failing)} size violation(s)")
        return 1
    print("sizes: ok")
    return 0


SELF_TEST = [
    # (source, expected [(first, last)] of functions)
    ("int f(int a,\n      int b) {\n  return a + b;\n}\n", [(1, 4)]),
    ('void g() {\n  const char *s = "}";\n  char c = \'{\';\n}\n', [(1, 4)]),
    ("void h() {\n  // }\n  /* { */\n}\n", [(1, 4)]),
    ('void r() {\n  auto s = R"x(})x";\n}\n', [(1, 3)]),
    ("namespace a {\nstruct S {\n  int m() const { return 1; }\n  S() : x{1}, y(2) {\n  }\n"
     "  int x, y;\n};\n}\n", [(3, 3), (4, 5)]),
    ("TEST(Suite, Name) {\n  if (x) {\n  }\n}\n", [(1, 4)]),
    ("static const int t[] = {1, 2};\nenum class E { A, B };\nauto k() -> int {\n  return 0;\n}\n",
     [(3, 5)]),
    ("#define X() { \\\n  }\ntemplate <typename T>\nT id(T v) {\n  return v;\n}\n", [(3, 6)]),
    ("class C {\npublic:\n  void run() {\n    auto l = [&]() { return 1; };\n  }\n};\n", [(3, 5)]),
    ("int n = 1'000;\nvoid q() {\n}\n", [(2, 3)]),
    ("int d(int a = 1,\n      int b = 2) {\n}\nbool operator==(A x, A y) {\n  return true;\n}\n",
     [(1, 3), (4, 6)]),
    ("void e(Options o = {}) {\n}\nMACRO(x)\nstruct Y : Z {\n  void m() {\n  }\n};\n", [(1, 2), (5, 6)]),
    ("template <typename F> decltype(auto) v(F &&f) {\n  return f();\n}\n", [(1, 3)]),
]


def self_test():
    failed = 0
    for source, expected in SELF_TEST:
        got = [(a, b) for a, b, _ in functions(source)]
        if got != expected:
            failed += 1
            print(f"self-test: expected {expected}, got {got} for:\n{source}")
    print("self-test: ok" if not failed else f"self-test: {failed} failed")
    return 1 if failed else 0


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", default=os.path.join(os.path.dirname(__file__), ".."))
    parser.add_argument("--self-test", action="store_true")
    args = parser.parse_args()
    if args.self_test:
        return self_test()
    return check(os.path.abspath(args.root))


if __name__ == "__main__":
    sys.exit(main())
