#!/usr/bin/env python3
"""Checks the naming style (clang-tidy's readability-identifier-naming with the
repository's .clang-tidy) of the C++ files a change touches.

Usage: tools/check_naming.py [--build DIR] [--base REF] [--jobs N]

The changed files are the *.cpp and *.h that differ from the base (committed
or not, and new untracked ones): the base is --base (or $PIPEC_NAMING_BASE),
else the merge-base of HEAD with origin/main, else HEAD~1. With no base (not
a git checkout, or a single commit), nothing is checked and one line says so.

A .cpp is checked as compiled (DIR/compile_commands.json); a header through a
translation unit that includes it, its diagnostics alone counted. Files the
build does not compile (and CUDA sources) are skipped.

Exit status: 1 when a changed file breaks the naming style (or clang-tidy
cannot parse it), 0 otherwise.
"""
import argparse
import concurrent.futures
import json
import os
import re
import shutil
import subprocess
import sys

EXTENSIONS = (".cpp", ".h")
CHECK = "readability-identifier-naming"


def git(root, *args):
    """git's output, or None when the command fails."""
    try:
        return subprocess.run(
            ["git", "-C", root, *args], check=True, capture_output=True, text=True
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        return None


def find_base(root, requested):
    """(commit, description) of the base to diff against, or (None, why)."""
    if requested:
        commit = git(root, "rev-parse", "--verify", "-q", requested + "^{commit}")
        if commit is None:
            return None, f"base '{requested}' is not a commit"
        return commit.strip(), requested
    if git(root, "rev-parse", "--verify", "-q", "HEAD") is None:
        return None, "not a git checkout with commits"
    if git(root, "rev-parse", "--verify", "-q", "origin/main") is not None:
        base = git(root, "merge-base", "origin/main", "HEAD")
        if base:
            return base.strip(), "the merge-base with origin/main"
    parent = git(root, "rev-parse", "--verify", "-q", "HEAD~1")
    if parent:
        return parent.strip(), "HEAD~1"
    return None, "no origin/main and no HEAD~1"


def changed_files(root, base):
    """Repository-relative paths of the C++ files changed since base."""
    diff = git(root, "diff", "--name-only", "--diff-filter=ACMR", base) or ""
    new = git(root, "ls-files", "--others", "--exclude-standard") or ""
    paths = set(diff.splitlines()) | set(new.splitlines())
    return sorted(p for p in paths if p.endswith(EXTENSIONS) and os.path.isfile(os.path.join(root, p)))


def translation_units(build):
    with open(os.path.join(build, "compile_commands.json")) as f:
        entries = json.load(f)
    units = {}
    for e in entries:
        path = e["file"]
        if not os.path.isabs(path):
            path = os.path.join(e["directory"], path)
        units[os.path.realpath(path)] = path
    return units


def unit_for_header(root, header, units):
    """A compiled .cpp that includes header (repository-relative), or None:
    the one beside it with its name first, else the first that names it in
    an #include."""
    stem = os.path.realpath(os.path.join(root, os.path.splitext(header)[0] + ".cpp"))
    if stem in units:
        return stem
    pattern = re.compile(r'#\s*include\s*"' + re.escape(header) + '"')
    for unit in sorted(units):
        if not unit.startswith(os.path.realpath(root) + os.sep):
            continue
        try:
            with open(unit, encoding="utf-8", errors="replace") as f:
                if pattern.search(f.read()):
                    return unit
        except OSError:
            continue
    return None


DIAGNOSTIC = re.compile(r"^(?P<path>[^\s:][^:]*):(?P<line>\d+):(?P<col>\d+): (?P<kind>warning|error): (?P<text>.*)$")


def run_tidy(tidy, build, config, unit, header_filter):
    proc = subprocess.run(
        [tidy, "-p", build, f"--config-file={config}", f"--checks=-*,{CHECK}",
         f"--header-filter={header_filter}", "--quiet", unit],
        capture_output=True,
        text=True,
    )
    return proc.stdout + proc.stderr


def main():
    root = os.path.realpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--build", default=os.path.join(root, "build"))
    parser.add_argument("--base", default=os.environ.get("PIPEC_NAMING_BASE", ""))
    parser.add_argument("--jobs", type=int, default=int(os.environ.get("PIPEC_JOBS", "2")))
    args = parser.parse_args()

    base, described = find_base(root, args.base)
    if base is None:
        print(f"naming: nothing checked ({described} to diff against)")
        return 0
    files = changed_files(root, base)
    if not files:
        print(f"naming: no C++ files changed since {described}")
        return 0
    tidy = shutil.which("clang-tidy") or shutil.which("clang-tidy-14")
    if not tidy:
        print("naming: clang-tidy not found (tools/install-deps.sh installs it)")
        return 1
    if not os.path.isfile(os.path.join(args.build, "compile_commands.json")):
        print(f"naming: no {args.build}/compile_commands.json (build first: tools/build.sh)")
        return 1
    units = translation_units(args.build)

    checked = {os.path.realpath(os.path.join(root, f)): f for f in files}
    headers = [f for f in files if f.endswith(".h")]
    to_run = set()
    skipped = []
    for f in files:
        real = os.path.realpath(os.path.join(root, f))
        unit = real if f.endswith(".cpp") else unit_for_header(root, f, units)
        if unit in units:
            to_run.add(unit)
        else:
            skipped.append(f)
    # Headers are seen through the build's include views (links to source
    # folders): match them by their repository path.
    header_filter = (
        "(^|/)(" + "|".join(re.escape(h) for h in headers) + ")$" if headers else "^$"
    )
    config = os.path.join(root, ".clang-tidy")
    problems = set()
    with concurrent.futures.ThreadPoolExecutor(max(1, args.jobs)) as pool:
        outputs = pool.map(
            lambda u: run_tidy(tidy, args.build, config, units[u], header_filter), sorted(to_run)
        )
        for output in outputs:
            for line in output.splitlines():
                m = DIAGNOSTIC.match(line)
                if not m:
                    continue
                path = m.group("path")
                if not os.path.isabs(path):
                    path = os.path.join(args.build, path)
                path = os.path.realpath(path)
                if path not in checked:
                    continue
                if m.group("kind") == "warning" and not line.endswith(f"[{CHECK}]"):
                    continue
                problems.add(f"{checked[path]}:{m.group('line')}:{m.group('col')}: {m.group('text')}")
    for p in sorted(problems):
        print(p)
    note = f"; {len(skipped)} not compiled here, skipped: {' '.join(skipped)}" if skipped else ""
    summary = f"{len(files) - len(skipped)} C++ file(s) changed since {described}{note}"
    if problems:
        print(f"naming: {len(problems)} problem(s) in {summary}")
        return 1
    print(f"naming: ok, {summary}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
