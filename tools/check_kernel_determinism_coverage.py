#!/usr/bin/env python3
"""Fail CI when a kernel-bearing file is not covered by a bitwise replay test.

A kernel that rounds differently from run to run breaks reproducible training and turns the
exactness tests of shared-prefix training flaky, and such a regression is invisible in review. This
gate keeps every kernel family registered in tests/unit_tests/determinism/kernels/manifest.py with
the replay tests that pin it, and asks that a change to a kernel comes with a change to a test.

Rules (a violation of any of them exits with status 1):
  1. Every kernel-bearing file under the manifest's GOVERNED_PATHS (its code matches one of the
     KERNEL_PATTERNS; comments and string literals of Python files are ignored) is a source of an
     entry.
  2. Every registered source exists, and every registered test exists: "path/test_x.py" must be a
     file; "path/test_x.py::test_name" must also define test_name (def or class) in that file.
  3. An entry has tests or a non-blank exempt_reason; an exempt_reason of "" (exempt without a
     reason) is an error.
  4. With --base-ref REF: when a source of an entry differs from REF (committed, staged, unstaged
     and untracked changes all count), one of that entry's test files differs from REF too.
     A Python source whose code is unchanged (same syntax tree once docstrings are dropped: a
     change of comments, docstrings or formatting only) is noted, not required to change a test.
     Exempt entries without tests are only listed. --no-require-test-update turns these failures
     into notes. A REF that names no commit (HEAD~1 on a first commit) skips this rule, with a note.

Exit status: 0 all rules hold; 1 coverage violations (listed); 2 usage error, unreadable manifest
or git failure. Standard library only, so it runs before anything is installed.
"""

import argparse
import ast
import importlib.util
import io
import posixpath
import re
import subprocess
import sys
import tokenize
from pathlib import Path

DEFAULT_MANIFEST = "tests/unit_tests/determinism/kernels/manifest.py"
EXIT_OK, EXIT_VIOLATIONS, EXIT_ERROR = 0, 1, 2


class UsageError(Exception):
    """A problem with the invocation or the environment, not with coverage (exit status 2)."""


def load_manifest(path):
    """Import manifest.py by file path, without the test package (or torch) around it."""
    if not path.is_file():
        raise UsageError(f"manifest not found: {path}")
    spec = importlib.util.spec_from_file_location("_kernel_determinism_manifest", path)
    module = importlib.util.module_from_spec(spec)
    # dataclasses looks its module up in sys.modules, so register it while the module executes.
    sys.modules[spec.name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        raise UsageError(f"cannot load manifest {path}: {type(exc).__name__}: {exc}") from exc
    finally:
        sys.modules.pop(spec.name, None)
    for attr in ("ENTRIES", "GOVERNED_PATHS", "KERNEL_PATTERNS", "SCANNED_SUFFIXES", "KINDS"):
        if not hasattr(module, attr):
            raise UsageError(f"manifest {path} defines no {attr}")
    return module


def code_text(path):
    """Return a file's text with Python comments and string literals blanked, lines kept.

    Docstrings often name kernels a file does *not* use; only code makes a file kernel-bearing. A
    Python file that does not tokenize (mid-edit) is scanned raw, erring towards registering it.
    """
    text = path.read_text(encoding="utf-8", errors="replace")
    if path.suffix != ".py":
        return text
    # Python 3.12 splits f-strings into tokens; their literal parts are FSTRING_MIDDLE.
    blanked = {tokenize.COMMENT, tokenize.STRING, getattr(tokenize, "FSTRING_MIDDLE", None)}
    try:
        tokens = list(tokenize.generate_tokens(io.StringIO(text).readline))
    except (tokenize.TokenError, SyntaxError):
        return text
    chars = [list(line) for line in text.splitlines(keepends=True)]
    for tok in tokens:
        if tok.type not in blanked:
            continue
        (first_row, first_col), (last_row, last_col) = tok.start, tok.end
        for row in range(first_row, last_row + 1):
            line = chars[row - 1]
            start = first_col if row == first_row else 0
            end = last_col if row == last_row else len(line)
            for i in range(start, end):
                if line[i] != "\n":
                    line[i] = " "
    return "".join("".join(line) for line in chars)


def compile_patterns(manifest):
    return {label: re.compile(rx, re.MULTILINE) for label, rx in manifest.KERNEL_PATTERNS.items()}


def kernel_hits(path, patterns):
    """The sorted (line, label) of the first match of each pattern in a file's code."""
    text = code_text(path)
    hits = []
    for label, rx in patterns.items():
        match = rx.search(text)
        if match:
            hits.append((text.count("\n", 0, match.start()) + 1, label))
    return sorted(hits)


def scan_kernel_files(root, manifest):
    """Map each kernel-bearing governed file (relative POSIX path) to its kernel_hits."""
    patterns = compile_patterns(manifest)
    found = {}
    for governed in manifest.GOVERNED_PATHS:
        base = root / governed
        candidates = [base] if base.is_file() else sorted(base.rglob("*")) if base.is_dir() else []
        for path in candidates:
            if path.is_file() and path.suffix in manifest.SCANNED_SUFFIXES:
                hits = kernel_hits(path, patterns)
                if hits:
                    found[path.relative_to(root).as_posix()] = hits
    return found


def split_test(test):
    """Split "file.py::Class::test" into the file path and the names it must define."""
    path, *names = test.split("::")
    return path, names


def is_path_tuple(value):
    return isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value)


def well_formed(entry):
    """Whether the entry has the fields that the path and change rules read, correctly typed."""
    fields = ("name", "sources", "tests", "kind", "exempt_reason")
    return (
        all(hasattr(entry, f) for f in fields)
        and is_path_tuple(entry.sources)
        and is_path_tuple(entry.tests)
    )


def check_entries(root, manifest):
    """Rules 2 and 3 plus the shape of each entry; returns the violation messages."""
    problems = []
    names = [getattr(e, "name", None) for e in manifest.ENTRIES]
    for index, entry in enumerate(manifest.ENTRIES):
        if not well_formed(entry):
            problems.append(
                f"ENTRIES[{index}] ({names[index]!r}) is not a KernelEntry whose sources and "
                "tests are tuples of path strings"
            )
            continue
        label = f"entry {entry.name!r}"
        if names.count(entry.name) > 1 and names.index(entry.name) == index:
            problems.append(f"{label}: name used by {names.count(entry.name)} entries")
        if entry.kind not in manifest.KINDS:
            kinds = ", ".join(manifest.KINDS)
            problems.append(f"{label}: kind {entry.kind!r} is not one of: {kinds}")
        if not entry.sources:
            problems.append(f"{label}: no sources")
        for path in entry.sources + tuple(split_test(t)[0] for t in entry.tests):
            if path != posixpath.normpath(path) or path.startswith(("/", "../")):
                problems.append(f"{label}: {path!r} is not a normalized repository-relative path")
        for source in entry.sources:
            if not (root / source).is_file():
                problems.append(f"{label}: source {source} does not exist")
        for test in entry.tests:
            problems.extend(f"{label}: {p}" for p in check_test_path(root, test))
        reason = entry.exempt_reason
        if reason is not None and (not isinstance(reason, str) or not reason.strip()):
            problems.append(f"{label}: exempt without a reason (exempt_reason must say why)")
        elif reason is None and not entry.tests:
            problems.append(f"{label}: has neither tests nor an exempt_reason")
    return problems


def check_test_path(root, test):
    """Check one test reference ("file.py" or "file.py::name[::name]") against the tree."""
    path, names = split_test(test)
    file = root / path
    if not file.is_file():
        return [f"test file {path} does not exist"]
    text = file.read_text(encoding="utf-8", errors="replace")
    return [
        f"test {test}: {name} is not defined in {path}"
        for name in names
        if not re.search(rf"^\s*(?:async\s+def|def|class)\s+{re.escape(name)}\b", text, re.M)
    ]


def git(root, *args):
    """Run git in the repository; a failure is an environment error (exit status 2)."""
    try:
        result = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True)
    except OSError as exc:
        raise UsageError(f"cannot run git: {exc}") from exc
    if result.returncode != 0:
        raise UsageError(f"git {' '.join(args)} failed: {result.stderr.strip()}")
    return result.stdout


def changed_paths(root, base_ref):
    """Paths that differ between base_ref and the working tree; None if base_ref is no commit."""
    git(root, "rev-parse", "--git-dir")
    probe = subprocess.run(
        ["git", "-C", str(root), "rev-parse", "--verify", "--quiet", f"{base_ref}^{{commit}}"],
        capture_output=True,
        text=True,
    )
    if probe.returncode != 0:
        return None
    # `git diff REF` compares REF with the working tree, so staged and unstaged edits count; -z
    # avoids path quoting; --no-renames reports both sides of a rename. Untracked files are new.
    diff = git(root, "diff", "--name-only", "--no-renames", "-z", base_ref, "--")
    untracked = git(root, "ls-files", "--others", "--exclude-standard", "--full-name", "-z")
    # Both list paths from the top of the git repository, which may lie above --repo-root.
    prefix = git(root, "rev-parse", "--show-prefix").strip()
    return {
        path[len(prefix) :] for path in (diff + untracked).split("\0") if path.startswith(prefix)
    } - {""}


def _code_fingerprint(source):
    """The syntax tree of Python ``source`` without docstrings, or None if it does not parse."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return None
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if (
            isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
            and body
            and isinstance(body[0], ast.Expr)
            and isinstance(body[0].value, ast.Constant)
            and isinstance(body[0].value.value, str)
        ):
            node.body = body[1:] or [ast.Pass()]
    return ast.dump(tree)


def same_code(root, base_ref, path):
    """Whether Python file ``path`` has the code it had at ``base_ref`` (comments, docstrings and
    formatting aside). A file that is new, removed, unparsable or not Python counts as changed."""
    if not path.endswith(".py") or not (root / path).is_file():
        return False
    prefix = git(root, "rev-parse", "--show-prefix").strip()
    old = subprocess.run(
        ["git", "-C", str(root), "show", f"{base_ref}:{prefix}{path}"],
        capture_output=True,
        text=True,
    )
    if old.returncode != 0:
        return False
    before = _code_fingerprint(old.stdout)
    return before is not None and before == _code_fingerprint((root / path).read_text())


def check_changes(manifest, changed):
    """Rule 4: (entries whose sources changed without a test change, notes on exempt entries)."""
    stale, notes = [], []
    for entry in filter(well_formed, manifest.ENTRIES):
        touched = ", ".join(sorted(set(entry.sources) & changed))
        if not touched:
            continue
        if not entry.tests:
            notes.append(f"entry {entry.name!r} changed ({touched}); exempt: {entry.exempt_reason}")
            continue
        test_files = sorted({split_test(t)[0] for t in entry.tests})
        if not set(test_files) & changed:
            stale.append(
                f"entry {entry.name!r}: {touched} changed but none of its tests did "
                f"({', '.join(test_files)}); update or extend a replay test for the change"
            )
    return stale, notes


def parse_args(argv):
    summary, details = __doc__.split("\n\n", 1)
    parser = argparse.ArgumentParser(
        description=summary,
        epilog=details,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--base-ref",
        metavar="REF",
        help="also require a test change for each entry whose sources changed since REF",
    )
    parser.add_argument(
        "--no-require-test-update",
        action="store_true",
        help="with --base-ref, report sources changed without a test change as notes only",
    )
    parser.add_argument(
        "--repo-root",
        metavar="PATH",
        type=Path,
        default=Path(__file__).resolve().parent.parent,
        help="repository root (default: the parent of this script's directory)",
    )
    parser.add_argument(
        "--manifest",
        metavar="PATH",
        type=Path,
        help=f"manifest file (default: REPO_ROOT/{DEFAULT_MANIFEST})",
    )
    return parser.parse_args(argv)


def run(args):
    """Apply every rule and print the report; returns the exit status."""
    root = args.repo_root.resolve()
    if not root.is_dir():
        raise UsageError(f"repository root {root} is not a directory")
    manifest = load_manifest(args.manifest or root / DEFAULT_MANIFEST)

    problems = check_entries(root, manifest)
    kernel_files = scan_kernel_files(root, manifest)
    registered = {s for e in filter(well_formed, manifest.ENTRIES) for s in e.sources}
    for path, hits in kernel_files.items():
        if path not in registered:
            found = "; ".join(f"line {line}: {label}" for line, label in hits)
            problems.append(f"unregistered kernel-bearing file {path} ({found}); register it")

    notes = []
    patterns = compile_patterns(manifest)
    for source in sorted(registered - set(kernel_files)):
        if (root / source).is_file() and not kernel_hits(root / source, patterns):
            notes.append(f"{source} is registered but matches no kernel pattern (still needed?)")
    if args.base_ref is not None:
        if not args.base_ref.strip():
            # Typically `--base-ref "$(git merge-base ...)"` whose git command failed.
            raise UsageError("--base-ref is empty (did the command that computes it fail?)")
        changed = changed_paths(root, args.base_ref)
        if changed is None:
            notes.append(
                f"--base-ref {args.base_ref} is not a commit in this repository (first commit?); "
                "skipped the changed-since check"
            )
        else:
            cosmetic = {p for p in changed & registered if same_code(root, args.base_ref, p)}
            notes.extend(
                f"{p} changed in comments, docstrings or formatting only" for p in sorted(cosmetic)
            )
            stale, change_notes = check_changes(manifest, changed - cosmetic)
            notes.extend(change_notes)
            if args.no_require_test_update:
                notes.extend(f"{s} (allowed by --no-require-test-update)" for s in stale)
            else:
                problems.extend(stale)

    for note in notes:
        print(f"note: {note}")
    governed = ", ".join(manifest.GOVERNED_PATHS)
    summary = f"{len(manifest.ENTRIES)} entries, {len(kernel_files)} kernel-bearing files"
    summary += f" in {governed}"
    if problems:
        print(f"kernel determinism coverage: {len(problems)} violation(s) ({summary})")
        for problem in problems:
            print(f"  - {problem}")
        print("See docs/determinism.md: how to register a kernel and write its replay test.")
        return EXIT_VIOLATIONS
    print(f"kernel determinism coverage OK ({summary})")
    return EXIT_OK


def main(argv=None):
    args = parse_args(argv)
    try:
        return run(args)
    except UsageError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_ERROR


if __name__ == "__main__":
    sys.exit(main())
