#!/usr/bin/env python3
"""Replaces the text between <!-- BEGIN NAME --> and <!-- END NAME --> in a document.

Usage: doc_section.py DOC NAME FILE   (FILE holds the new text; - reads standard input)
"""
import re
import sys


def write_section(doc_path, name, text):
    """Puts \p text between the document's BEGIN/END NAME markers, or exits naming what is missing."""
    doc = open(doc_path).read()
    section = f"<!-- BEGIN {name} -->\n{text.strip()}\n<!-- END {name} -->"
    doc, count = re.subn(rf"<!-- BEGIN {re.escape(name)} -->.*?<!-- END {re.escape(name)} -->",
                         lambda _: section, doc, flags=re.S)
    if count != 1:
        sys.exit(f"doc_section: {doc_path} has no BEGIN/END {name} markers")
    open(doc_path, "w").write(doc)
    print(f"doc_section: wrote the {name} section of {doc_path}")


def main():
    if len(sys.argv) != 4:
        sys.exit(__doc__.strip())
    doc_path, name, source = sys.argv[1:]
    write_section(doc_path, name, (sys.stdin if source == "-" else open(source)).read())


if __name__ == "__main__":
    main()
