#!/usr/bin/env python3
"""Export this repository as an upstream Megatron-LM PR stack: a git repository and its patches.

    python tools/export_pr_stack.py --out DIR [--base PATH]

DIR becomes a git repository whose first commit is the pristine upstream tree (the base) and whose
next commits are the PRs of tools/pr_stack_map.py, in dependency order; DIR/patches/NNNN-*.patch
are those commits as `git format-patch` writes them, for `git am` onto the same base.

The base is a Megatron-LM checkout given by --base (the real submission target: it has
pretrain_hybrid.py at its root), or by default the installed megatron-core package's own
megatron/core and megatron/training (what CI can reach without network). Upstream source is read
only from the base; nothing of it is stored in this repository.

Each PR commit moves files of this repository to their upstream homes (RULES), rewrites
``megatron.shared_prefix`` imports and paths to those homes, and makes the few in-place changes of
upstream files (UPSTREAM_EDITS), each anchored on a string that must occur exactly once. The export
fails, naming what to fix, when a file under the map's SCOPE matches no rule, an anchor is not found,
a moved file would overwrite an upstream file, ``megatron.shared_prefix`` would remain anywhere, or a
file would import a module that only a later PR adds (the stack would not bisect).

    python tools/export_pr_stack.py --check-docs docs/upstreaming.md
    python tools/export_pr_stack.py --out DIR --write-docs docs/upstreaming.md

check that docs/upstreaming.md's generated module map matches the map, or rewrite its generated
sections (module map, and the diffstat of the export just made). Exit status: 0 success, 1 export
or check failure (message on stderr). Standard library only.
"""

import argparse
import ast
import importlib.util
import os
import posixpath
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import pr_stack_map  # noqa: E402  pylint: disable=wrong-import-position

ROOT = Path(__file__).resolve().parent.parent
API_PACKAGE_SOURCE = "megatron/shared_prefix/__init__.py"
MANIFEST_SOURCE = "tests/unit_tests/determinism/kernels/manifest.py"
HYBRID_MODEL_SOURCE = "megatron/shared_prefix/models/hybrid/hybrid_model.py"
EXTENSION_MODULE = re.compile(r"megatron\.shared_prefix(?:\.[A-Za-z_][A-Za-z0-9_]*)*")
EXTENSION_PATH = re.compile(r"megatron/shared_prefix(?:/[A-Za-z0-9_][A-Za-z0-9_.]*)*/?")
LEFTOVER = re.compile(r"megatron[./]shared_prefix")
# One entry of the public API's lazy-import table: '    "name": "module",'.
API_ENTRY = re.compile(r'^\s+"(\w+)": "([\w.]+)",\n', re.M)
DOCS_BEGIN = "<!-- BEGIN GENERATED {name}: tools/export_pr_stack.py --write-docs -->"
DOCS_END = "<!-- END GENERATED {name} -->"


class ExportError(Exception):
    """A reason the stack cannot be exported as mapped; the message says what to change."""


@dataclass
class ExportedFile:
    """One file of this repository at its upstream home."""

    source: str
    target: str
    pr: int


@dataclass
class Plan:
    """Where every mapped source file goes, and the module names that follow from it."""

    files: list
    modules: dict  # source dotted module/package name -> target dotted name
    paths: dict  # source path (file, or directory without trailing "/") -> target path
    module_pr: dict = field(default_factory=dict)  # target dotted module -> PR that adds it


# ------------------------------------------------------------------------------------------------
# The map


def matching_rule(path):
    """The most specific rule for ``path``: its file rule, else its deepest directory rule."""
    best = None
    for rule in pr_stack_map.RULES:
        if rule.source == path:
            return rule
        if rule.source.endswith("/") and path.startswith(rule.source):
            if best is None or len(rule.source) > len(best.source):
                best = rule
    return best


def target_path(path, rule):
    if rule.source.endswith("/"):
        return rule.target + path[len(rule.source) :]
    return rule.target


def module_name(path):
    """Dotted module name of a .py path (a package for __init__.py)."""
    stem = path[: -len(".py")]
    if stem.endswith("/__init__"):
        stem = stem[: -len("/__init__")]
    return stem.replace("/", ".")


def in_scope(path):
    return any(path == s or (s.endswith("/") and path.startswith(s)) for s in pr_stack_map.SCOPE)


def source_files(source_root):
    """Tracked and untracked (not ignored) files of the source checkout under the map's SCOPE."""
    listed = subprocess.run(
        [
            "git",
            "-C",
            str(source_root),
            "ls-files",
            "-z",
            "--cached",
            "--others",
            "--exclude-standard",
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split("\0")
    return sorted({p for p in listed if p and in_scope(p) and (source_root / p).is_file()})


def plan_export(paths):
    """Map every source path; fail listing the paths that no rule covers."""
    numbers = {pr.number for pr in pr_stack_map.PULL_REQUESTS}
    unmapped, files, seen = [], [], {}
    for path in paths:
        rule = matching_rule(path)
        if rule is None:
            unmapped.append(path)
            continue
        if rule.target is None:
            continue
        if rule.pr not in numbers:
            raise ExportError(f"tools/pr_stack_map.py: rule for {rule.source} names PR {rule.pr}")
        target = target_path(path, rule)
        if target in seen:
            raise ExportError(f"{path} and {seen[target]} would both become {target}")
        seen[target] = path
        files.append(ExportedFile(path, target, rule.pr))
    if unmapped:
        raise ExportError(
            "files not in the upstream module map (add a rule to RULES in tools/pr_stack_map.py, "
            "with target=None and a note if a file stays out of the stack):\n  "
            + "\n  ".join(unmapped)
        )
    modules, path_map = {}, {}
    for exported in files:
        path_map[exported.source] = exported.target
        if exported.source.endswith(".py"):
            modules[module_name(exported.source)] = module_name(exported.target)
    for rule in pr_stack_map.RULES:
        if rule.target and rule.source.endswith("/"):
            path_map[rule.source.rstrip("/")] = rule.target.rstrip("/")
            if rule.source.startswith("megatron/"):
                modules[rule.source.rstrip("/").replace("/", ".")] = rule.target.rstrip(
                    "/"
                ).replace("/", ".")
    api_target = path_map.get(API_PACKAGE_SOURCE)
    if api_target:
        path_map["megatron/shared_prefix"] = posixpath.dirname(api_target)
    plan = Plan(files, modules, path_map)
    for exported in files:
        if exported.target.endswith(".py"):
            plan.module_pr[module_name(exported.target)] = exported.pr
    return plan


def add_api_names(plan, source_root):
    """Count ``from <API package> import NAME`` as an import of NAME's module (for bisection)."""
    if API_PACKAGE_SOURCE not in plan.paths:
        return
    package = module_name(plan.paths[API_PACKAGE_SOURCE])
    text = (source_root / API_PACKAGE_SOURCE).read_text(encoding="utf-8")
    for name, module in API_ENTRY.findall(text):
        pr = plan.module_pr.get(rewrite_names(module, plan, API_PACKAGE_SOURCE))
        if pr is not None:
            plan.module_pr[f"{package}.{name}"] = pr


# ------------------------------------------------------------------------------------------------
# Rewriting


def _longest(mapping, parts, sep):
    for end in range(len(parts), 0, -1):
        key = sep.join(parts[:end])
        if key in mapping:
            return mapping[key] + "".join(sep + p for p in parts[end:])
    return None


def rewrite_names(text, plan, where):
    """``megatron.shared_prefix...`` modules and ``megatron/shared_prefix/...`` paths -> upstream."""

    def module(match):
        new = _longest(plan.modules, match.group(0).split("."), ".")
        if new is None:
            raise ExportError(f"{where}: no upstream module for {match.group(0)}")
        return new

    def path(match):
        found = match.group(0)
        trailing = "/" if found.endswith("/") else ""
        new = _longest(plan.paths, found.rstrip("/").split("/"), "/")
        if new is None:
            raise ExportError(f"{where}: no upstream path for {found}")
        return new + trailing

    return EXTENSION_PATH.sub(path, EXTENSION_MODULE.sub(module, text))


def _test_module_target(source_path, plan):
    target = plan.paths.get(source_path)
    return module_name(target) if target else None


def _resolve_test_import(importer, level, name, plan, source_root):
    """Target dotted name of a test helper imported by ``importer`` (None: not one of ours).

    Relative imports resolve from the importer's package; bare names as pytest resolves them here:
    the importer's own directory first (prepend import mode), then tests/unit_tests (pyproject's
    pythonpath).
    """
    parts = name.split(".") if name else []
    if level:
        base = posixpath.dirname(importer)
        for _ in range(level - 1):
            base = posixpath.dirname(base)
        roots = [base]
    else:
        roots = [posixpath.dirname(importer), "tests/unit_tests"]
    for root in roots:
        stem = posixpath.join(root, *parts)
        for candidate in (stem + ".py", stem + "/__init__.py"):
            if (source_root / candidate).is_file():
                return _test_module_target(candidate, plan)
    return None


_FROM_IMPORT = re.compile(
    r"^(?P<indent>\s*)from (?P<dots>\.*)(?P<name>[A-Za-z_][\w.]*)? import ", re.M
)


_IMPORT = re.compile(
    r"^(?P<indent>\s*)import (?P<name>[A-Za-z_][\w.]*)(?P<rest>\s*(?:#.*)?)$", re.M
)


def rewrite_test_imports(text, source, plan, source_root):
    """Relative and bare-name imports of test helpers -> absolute ``tests.unit_tests...`` names."""

    def replace(match):
        level, name = len(match.group("dots")), match.group("name") or ""
        if not level and (name.split(".")[0] in {"megatron", "tests"} or not name):
            return match.group(0)
        target = _resolve_test_import(source, level, name, plan, source_root)
        if target is None:
            if level:
                raise ExportError(f"{source}: cannot resolve relative import of {name!r}")
            return match.group(0)
        return f"{match.group('indent')}from {target} import "

    def replace_import(match):
        name = match.group("name")
        if name.split(".")[0] in {"megatron", "tests"}:
            return match.group(0)
        target = _resolve_test_import(source, 0, name, plan, source_root)
        if target is None:
            return match.group(0)
        package, _, leaf = target.rpartition(".")
        local = name.rpartition(".")[2]
        alias = f" as {local}" if local != leaf else ""
        return f"{match.group('indent')}from {package} import {leaf}{alias}{match.group('rest')}"

    return _IMPORT.sub(replace_import, _FROM_IMPORT.sub(replace, text))


_LONG_FROM_IMPORT = re.compile(r"^(\s*)from ([\w.]+) import ([^()#\n]+?)(\s*#[^\n]*)?$")


def wrap_long_imports(text, width=100):
    """``from X import a, b`` lines that the longer upstream names pushed past ``width``, in
    black's parenthesized form (one name per line; a trailing comment stays on the first line)."""
    lines = []
    for line in text.split("\n"):
        match = _LONG_FROM_IMPORT.match(line) if len(line) > width else None
        if match is None:
            lines.append(line)
            continue
        indent, module, names, comment = match.groups()
        comment = f"  {comment.strip()}" if comment else ""
        lines.append(f"{indent}from {module} import ({comment}")
        lines.extend(f"{indent}    {name.strip()}," for name in names.split(","))
        lines.append(f"{indent})")
    return "\n".join(lines)


def rewrite_test_paths(text, plan):
    """Paths of moved test files (the manifest's test references, docstrings) -> their new paths."""
    moved = {
        f.source: f.target
        for f in plan.files
        if f.source.startswith("tests/") and f.source != f.target
    }
    if not moved:
        return text
    pattern = re.compile(
        r"(?<![\w/])("
        + "|".join(re.escape(p) for p in sorted(moved, key=len, reverse=True))
        + r")(?![\w.])"
    )
    return pattern.sub(lambda match: moved[match.group(1)], text)


def drop_method(text, class_name, method, where):
    """``text`` without ``class_name.method`` (its lines, and the blank line before it)."""
    tree = ast.parse(text)
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == class_name:
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and item.name == method:
                    lines = text.splitlines(keepends=True)
                    first = min([item.lineno] + [d.lineno for d in item.decorator_list]) - 1
                    while first > 0 and not lines[first - 1].strip():
                        first -= 1
                    return "".join(lines[:first] + lines[item.end_lineno :])
    raise ExportError(f"{where}: {class_name}.{method} not found (the export drops it)")


def staged_api(text, plan, pr, where):
    """The public API table with only the names whose modules exist at ``pr``."""
    if not API_ENTRY.search(text):
        raise ExportError(f"{where}: no _EXPORTS entries of the form '    \"name\": \"module\",'")

    def keep(match):
        return match.group(0) if plan.module_pr.get(match.group(2), 0) <= pr else ""

    return API_ENTRY.sub(keep, text)


def governed_paths(plan, base_files):
    """The exported manifest's GOVERNED_PATHS: the new directories our modules land in (and any
    module of ours that lands in an upstream directory), never upstream's own kernel files."""
    governed = set()
    for exported in plan.files:
        ours = exported.source.startswith("megatron/") or exported.source == "pretrain_hybrid.py"
        if not ours or not exported.target.endswith(".py"):
            continue
        directory = posixpath.dirname(exported.target)
        new_dir = not any(f.startswith(directory + "/") for f in base_files)
        governed.add(directory if new_dir else exported.target)
    return sorted(governed)


def exported_text(exported, plan, pr, source_root, base_files):
    """The text of ``exported`` as of PR ``pr`` (its content can depend on the PR: the API)."""
    text = (source_root / exported.source).read_text(encoding="utf-8")
    where = exported.source
    if exported.source == MANIFEST_SOURCE:
        line = '    "megatron/shared_prefix",\n'
        if text.count(line) != 1:
            raise ExportError(f"{where}: anchor {line.strip()!r} (GOVERNED_PATHS) not found once")
        text = text.replace(
            line, "".join(f'    "{p}",\n' for p in governed_paths(plan, base_files))
        )
    if exported.source == HYBRID_MODEL_SOURCE:
        # Upstream, HybridModel.forward itself takes shared_prefix_layout (UPSTREAM_EDITS).
        text = drop_method(text, "SharedPrefixHybridModel", "forward", where)
    if exported.target.startswith("tests/") and exported.target.endswith(".py"):
        text = rewrite_test_imports(text, exported.source, plan, source_root)
    text = rewrite_names(text, plan, where)
    text = rewrite_test_paths(text, plan)
    if exported.target.endswith(".py"):
        text = wrap_long_imports(text)
    if exported.source == API_PACKAGE_SOURCE:
        text = staged_api(text, plan, pr, where)
    return text


def apply_edit(tree, edit):
    """Make one anchored in-place edit in the export tree; fail naming file and anchor."""
    path = tree / edit.path
    if not path.is_file():
        if edit.when_missing is None:
            raise ExportError(f"{edit.path}: not in the base, which this stack edits ({edit.note})")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(edit.when_missing, encoding="utf-8")
        return
    text = path.read_text(encoding="utf-8")
    if not edit.anchor:
        path.write_text(text + edit.replacement, encoding="utf-8")
        return
    count = text.count(edit.anchor)
    if count != 1:
        raise ExportError(
            f"{edit.path}: anchor {edit.anchor!r} found {count} times, expected once; upstream "
            f"moved ({edit.note}). See docs/upstreaming.md, 'When an anchor fails'."
        )
    path.write_text(text.replace(edit.anchor, edit.replacement), encoding="utf-8")


# ------------------------------------------------------------------------------------------------
# Checks on the exported text


def imported_modules(text, target):
    """Absolute module names a Python file imports anywhere (top level or inside functions)."""
    try:
        tree = ast.parse(text)
    except SyntaxError as exc:
        raise ExportError(f"{target}: does not parse after the export: {exc}") from exc
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def check_import_order(texts, plan):
    """Every import of one of our modules refers to a module of the same or an earlier PR."""
    problems, depends = [], {}
    for target, (pr, text) in texts.items():
        if not target.endswith(".py"):
            continue
        for name in imported_modules(text, target):
            needed = plan.module_pr.get(name)
            if needed is None:
                continue
            if needed > pr:
                problems.append(f"{target} (PR {pr}) imports {name}, which PR {needed} adds")
            elif needed < pr:
                depends.setdefault(pr, set()).add(needed)
    if problems:
        raise ExportError("the stack would not bisect:\n  " + "\n  ".join(sorted(problems)))
    return depends


def check_no_extension_left(tree, targets):
    leftovers = []
    for target in targets:
        path = tree / target
        if not path.is_file():
            continue
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if LEFTOVER.search(line):
                leftovers.append(f"{target}:{number}: {line.strip()}")
    if leftovers:
        raise ExportError(
            "megatron.shared_prefix remains in the export:\n  " + "\n  ".join(leftovers)
        )


# ------------------------------------------------------------------------------------------------
# The base and the git repository


def default_base():
    """The directory holding the installed megatron-core's megatron/core."""
    spec = importlib.util.find_spec("megatron.core")
    if spec is None or not spec.origin:
        raise ExportError("megatron-core is not installed here; pass --base PATH")
    return Path(spec.origin).resolve().parent.parent.parent


def base_listing(base):
    """Files of the base: a git checkout's tracked files, else megatron/core and megatron/training."""
    if (base / ".git").exists():
        listed = subprocess.run(
            ["git", "-C", str(base), "ls-files", "-z"], capture_output=True, text=True, check=True
        ).stdout.split("\0")
        return [p for p in listed if p and (base / p).is_file() and not (base / p).is_symlink()]
    files = []
    for package in ("megatron/core", "megatron/training"):
        if not (base / package).is_dir():
            raise ExportError(f"base {base} has no {package}")
        for path in sorted((base / package).rglob("*")):
            if path.is_file() and "__pycache__" not in path.parts and path.suffix != ".pyc":
                files.append(path.relative_to(base).as_posix())
    return files


def describe_base(base):
    if (base / ".git").exists():
        rev = subprocess.run(
            ["git", "-C", str(base), "describe", "--always", "--tags", "--dirty"],
            capture_output=True,
            text=True,
        ).stdout.strip()
        return f"Megatron-LM checkout {base.name} at {rev or 'unknown revision'}"
    info = (base / "megatron/core/package_info.py").read_text(encoding="utf-8")
    numbers = dict(re.findall(r"^(MAJOR|MINOR|PATCH) = (\d+)", info, re.M))
    version = ".".join(numbers.get(k, "?") for k in ("MAJOR", "MINOR", "PATCH"))
    return f"megatron-core {version} package (megatron/core and megatron/training only)"


class Repo:
    """The export's git repository, with fixed dates so that the same input gives the same patches."""

    def __init__(self, path, signoff, date):
        self.path = path
        self.signoff = signoff
        name, email = re.fullmatch(r"(.+?) <(.+)>", signoff).groups()
        self.env = dict(
            os.environ,
            GIT_AUTHOR_NAME=name,
            GIT_AUTHOR_EMAIL=email,
            GIT_COMMITTER_NAME=name,
            GIT_COMMITTER_EMAIL=email,
            GIT_AUTHOR_DATE=date,
            GIT_COMMITTER_DATE=date,
        )

    def git(self, *args):
        result = subprocess.run(
            ["git", "-C", str(self.path), *args], capture_output=True, text=True, env=self.env
        )
        if result.returncode != 0:
            raise ExportError(f"git {' '.join(args[:2])} failed: {result.stderr.strip()}")
        return result.stdout

    def commit(self, message):
        self.git("add", "-A")
        subprocess.run(
            ["git", "-C", str(self.path), "commit", "-q", "--no-verify", "-F", "-"],
            input=message,
            text=True,
            env=self.env,
            check=True,
            capture_output=True,
        )
        return self.git("rev-parse", "HEAD").strip()


def git_signoff(source_root):
    def config(key):
        return subprocess.run(
            ["git", "-C", str(source_root), "config", key], capture_output=True, text=True
        ).stdout.strip()

    name, email = config("user.name"), config("user.email")
    if not name or not email:
        raise ExportError(
            "git config user.name / user.email are not set; set them or pass --signoff"
        )
    return f"{name} <{email}>"


def source_date(source_root):
    return subprocess.run(
        ["git", "-C", str(source_root), "log", "-1", "--format=%cI"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()


# ------------------------------------------------------------------------------------------------
# Commit messages and statistics


@dataclass
class Diffstat:
    """Lines a PR adds in files new to the base vs lines it changes in upstream files."""

    new_files: int = 0
    new_lines: int = 0
    upstream_files: int = 0
    upstream_added: int = 0
    upstream_removed: int = 0

    @property
    def fraction(self):
        total = self.new_lines + self.upstream_added + self.upstream_removed
        return (self.upstream_added + self.upstream_removed) / total if total else 0.0


def count_tests(text):
    return len(re.findall(r"^\s*(?:async\s+)?def test_\w+", text, re.M))


def commit_message(pr, depends, required_by, tests, stat_line, signoff):
    titles = {p.number: p.title for p in pr_stack_map.PULL_REQUESTS}

    count = len(pr_stack_map.PULL_REQUESTS)

    def refs(numbers):
        return "".join(f"\n  - PR {n}/{count}: {titles[n]}" for n in sorted(numbers)) or " none"

    test_dirs = sorted({posixpath.dirname(t) for t in tests})
    total = sum(tests.values())
    lines = [
        f"{pr.title}",
        "",
        f"PR {pr.number}/{count} of the shared-prefix training stack.",
        "",
        "Summary",
        "",
        _wrap(pr.summary),
        "",
        "Dependencies",
        "",
        f"- Depends on (imports from):{refs(depends)}",
        f"- Required by:{refs(required_by)}",
        "",
        "Validation",
        "",
        (
            f"- `python -m pytest -q {' '.join(test_dirs)}`: {total} test functions in "
            f"{len(tests)} files added by this PR (CPU; GPU tests are marked `gpu`)."
            if tests
            else "- No tests of its own: exercised by the tests of the PRs that require it."
        ),
        "- " + _wrap(pr.validation, indent="  "),
        f"- Diffstat: {stat_line}",
        "",
        "Known limitations",
        "",
        _wrap(pr.limitations),
        "",
        f"Signed-off-by: {signoff}",
        "",
    ]
    return "\n".join(lines)


def _wrap(text, width=72, indent=""):
    words, lines, current = text.split(), [], ""
    for word in words:
        if current and len(current) + 1 + len(word) > width:
            lines.append(current)
            current = indent + word
        else:
            current = f"{current} {word}" if current else word
    if current:
        lines.append(current)
    return "\n".join(lines)


def stat_text(stat):
    return (
        f"+{stat.new_lines} lines in {stat.new_files} new files; "
        f"+{stat.upstream_added}/-{stat.upstream_removed} lines in {stat.upstream_files} upstream "
        f"files ({100 * stat.fraction:.1f}% of changed lines)"
    )


# ------------------------------------------------------------------------------------------------
# The export


def ensure_test_packages(tree, targets):
    """Every directory from tests/ to an exported test file is a package (unique module names)."""
    for target in targets:
        if not target.startswith("tests/"):
            continue
        directory = posixpath.dirname(target)
        while directory:
            init = tree / directory / "__init__.py"
            if not init.exists():
                init.parent.mkdir(parents=True, exist_ok=True)
                init.write_text("", encoding="utf-8")
            directory = posixpath.dirname(directory)


def export(out, base, source_root=ROOT, signoff=None):
    """Write the stack to ``out``; returns {PR number: Diffstat}."""
    out, base = Path(out).resolve(), Path(base).resolve()
    if out.exists() and any(out.iterdir()):
        raise ExportError(f"--out {out} exists and is not empty")
    plan = plan_export(source_files(source_root))
    add_api_names(plan, source_root)
    listing = base_listing(base)
    base_files = set(listing)
    collisions = [f"{f.source} -> {f.target}" for f in plan.files if f.target in base_files]
    collisions = [c for c in collisions if not c.endswith("__init__.py")]
    if collisions:
        raise ExportError(
            "moved files would overwrite upstream files:\n  " + "\n  ".join(collisions)
        )
    signoff = signoff or git_signoff(source_root)
    if not re.fullmatch(r".+? <.+>", signoff):
        raise ExportError(f"--signoff {signoff!r} is not 'Name <email>'")

    out.mkdir(parents=True, exist_ok=True)
    for path in listing:
        destination = out / path
        destination.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(base / path, destination)
    repo = Repo(out, signoff, source_date(source_root))
    repo.git("init", "-q", "-b", "main")
    (out / ".git/info/exclude").write_text("/patches/\n__pycache__/\n", encoding="utf-8")
    description = describe_base(base)
    base_commit = repo.commit(
        f"Base: {description}\n\nThe pristine upstream tree that the PR stack applies to.\n"
    )

    # The stack's final text of every moved file (an empty package __init__.py that upstream
    # already has is not moved), for the import-order check.
    last, texts = pr_stack_map.PULL_REQUESTS[-1].number, {}
    for exported in plan.files:
        if exported.target in base_files and exported.target.endswith("__init__.py"):
            if (source_root / exported.source).read_text(encoding="utf-8").strip():
                raise ExportError(f"{exported.source} would overwrite {exported.target}")
            continue
        text = exported_text(exported, plan, last, source_root, base_files)
        texts[exported.target] = (exported.pr, text)
    depends = check_import_order(texts, plan)

    stats = {}
    ours = {f.target for f in plan.files}
    for pr in pr_stack_map.PULL_REQUESTS:
        present = [f for f in plan.files if f.pr <= pr.number and f.target in texts]
        for exported in present:
            path = out / exported.target
            path.parent.mkdir(parents=True, exist_ok=True)
            text = exported_text(exported, plan, pr.number, source_root, base_files)
            path.write_text(text, encoding="utf-8")
            shutil.copymode(source_root / exported.source, path)
        ensure_test_packages(out, [f.target for f in present])
        for edit in pr_stack_map.UPSTREAM_EDITS:
            if edit.pr == pr.number:
                apply_edit(out, edit)
        for path, (number, content) in pr_stack_map.GENERATED_FILES.items():
            if number == pr.number:
                (out / path).parent.mkdir(parents=True, exist_ok=True)
                (out / path).write_text(content, encoding="utf-8")
        check_no_extension_left(out, ours | {e.path for e in pr_stack_map.UPSTREAM_EDITS})
        repo.git("add", "-A")
        staged = repo.git("diff", "--cached", "--name-only").split()
        stat = diffstat_of_index(repo, base_files)
        tests = {
            t: count_tests((out / t).read_text(encoding="utf-8"))
            for t in staged
            if posixpath.basename(t).startswith("test_") and t.endswith(".py")
        }
        required_by = {n for n, deps in depends.items() if pr.number in deps}
        message = commit_message(
            pr, depends.get(pr.number, set()), required_by, tests, stat_text(stat), signoff
        )
        repo.commit(message)
        stats[pr.number] = stat
    patches = out / "patches"
    repo.git("format-patch", "-q", "-o", str(patches), f"{base_commit}..HEAD")
    return stats


def diffstat_of_index(repo, base_files):
    stat = Diffstat()
    for line in repo.git("diff", "--cached", "--numstat").splitlines():
        added, removed, path = line.split("\t")
        added = int(added) if added != "-" else 0
        removed = int(removed) if removed != "-" else 0
        if path in base_files:
            stat.upstream_files += 1
            stat.upstream_added += added
            stat.upstream_removed += removed
        else:
            stat.new_files += 1
            stat.new_lines += added
    return stat


# ------------------------------------------------------------------------------------------------
# docs/upstreaming.md


def module_map_markdown():
    lines = ["The stack, in dependency order:", ""]
    lines += [f"{pr.number}. {pr.title}" for pr in pr_stack_map.PULL_REQUESTS]
    lines += ["", "| PR | this repository | upstream | how it plugs in |", "|---|---|---|---|"]
    by_pr = sorted((r for r in pr_stack_map.RULES if r.target), key=lambda r: (r.pr, r.source))
    for rule in by_pr:
        lines.append(f"| {rule.pr} | `{rule.source}` | `{rule.target}` | {rule.note} |")
    lines += ["", "Not exported:", ""]
    for rule in sorted((r for r in pr_stack_map.RULES if not r.target), key=lambda r: r.source):
        lines.append(f"- `{rule.source}`: {rule.note}")
    lines += ["", "In-place edits of upstream files (anchored), and files the exporter writes:", ""]
    entries = []
    for edit in pr_stack_map.UPSTREAM_EDITS:
        anchor = edit.anchor.strip().splitlines()[0] if edit.anchor.strip() else "(end of file)"
        missing = "; created when the base lacks it" if edit.when_missing else ""
        entries.append((edit.pr, f"`{edit.path}`: {edit.note} (anchor `{anchor}`{missing})"))
    for path, (number, _) in pr_stack_map.GENERATED_FILES.items():
        entries.append((number, f"`{path}`: new file written by the exporter"))
    lines += [f"- PR {number}, {text}" for number, text in sorted(entries, key=lambda e: e[0])]
    return "\n".join(lines)


def diffstat_markdown(stats, description):
    titles = {pr.number: pr.title for pr in pr_stack_map.PULL_REQUESTS}
    lines = [
        f"Export against the {description}:",
        "",
        "| PR | title | new files | lines in new files | upstream files | upstream lines +/- | "
        "in-place share |",
        "|---|---|---|---|---|---|---|",
    ]
    total = Diffstat()
    for number, stat in stats.items():
        lines.append(
            f"| {number} | {titles[number]} | {stat.new_files} | {stat.new_lines} | "
            f"{stat.upstream_files} | +{stat.upstream_added}/-{stat.upstream_removed} | "
            f"{100 * stat.fraction:.1f}% |"
        )
        for name in (
            "new_files",
            "new_lines",
            "upstream_files",
            "upstream_added",
            "upstream_removed",
        ):
            setattr(total, name, getattr(total, name) + getattr(stat, name))
    lines.append(
        f"| all | | {total.new_files} | {total.new_lines} | {total.upstream_files} | "
        f"+{total.upstream_added}/-{total.upstream_removed} | {100 * total.fraction:.1f}% |"
    )
    return "\n".join(lines)


def generated_section(text, name):
    begin, end = DOCS_BEGIN.format(name=name), DOCS_END.format(name=name)
    if begin not in text or end not in text:
        raise ExportError(f"docs: no generated section {name!r} ({begin} ... {end})")
    return text.index(begin) + len(begin), text.index(end)


def replace_section(text, name, body):
    start, stop = generated_section(text, name)
    return text[:start] + "\n" + body + "\n" + text[stop:]


def check_docs(path):
    text = Path(path).read_text(encoding="utf-8")
    start, stop = generated_section(text, "module map")
    if text[start:stop].strip() != module_map_markdown().strip():
        raise ExportError(
            f"{path}: the module map differs from tools/pr_stack_map.py; regenerate it with "
            f"`python tools/export_pr_stack.py --write-docs {path}` (with --out DIR, the "
            "diffstat too)"
        )


def write_docs(path, stats, description):
    text = Path(path).read_text(encoding="utf-8")
    text = replace_section(text, "module map", module_map_markdown())
    if stats is not None:
        text = replace_section(text, "diffstat", diffstat_markdown(stats, description))
    Path(path).write_text(text, encoding="utf-8")


def parse_args(argv):
    summary, details = __doc__.split("\n\n", 1)
    parser = argparse.ArgumentParser(
        description=summary, epilog=details, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, help="directory to create (must be empty or absent)")
    parser.add_argument(
        "--base",
        type=Path,
        help="Megatron-LM checkout (default: the installed megatron-core's megatron/core and "
        "megatron/training)",
    )
    parser.add_argument("--signoff", help="'Name <email>' (default: git config of this repository)")
    parser.add_argument("--write-docs", type=Path, metavar="MD", help="rewrite generated sections")
    parser.add_argument(
        "--check-docs", type=Path, metavar="MD", help="check the module map section"
    )
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    if not (args.out or args.check_docs or args.write_docs):
        print("error: nothing to do (give --out, --check-docs or --write-docs)", file=sys.stderr)
        return 2
    try:
        stats, description = None, None
        if args.out:
            base = args.base or default_base()
            description = describe_base(Path(base).resolve())
            stats = export(args.out, base, signoff=args.signoff)
            for number, stat in stats.items():
                print(f"PR {number}: {stat_text(stat)}")
            print(f"exported {len(stats)} PRs onto {description} in {args.out}")
        if args.write_docs:
            write_docs(args.write_docs, stats, description)
        if args.check_docs:
            check_docs(args.check_docs)
            print(f"{args.check_docs}: module map matches tools/pr_stack_map.py")
    except ExportError as exc:
        print(f"export_pr_stack: error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
