#!/usr/bin/env python3
"""CI check of the upstream PR stack: export it, then prove the exported tree works on its own.

    python tools/check_pr_stack.py [--base PATH] [--keep DIR]

1. docs/upstreaming.md's module map matches tools/pr_stack_map.py.
2. tools/export_pr_stack.py exports the stack into a temporary directory (default base: the
   installed megatron-core package).
3. An interpreter that sees this environment's packages but not this repository (a venv whose .pth
   adds the site-packages directory, so the editable install's finder is not loaded), with the
   exported tree first on PYTHONPATH, must fail to import megatron.shared_prefix.
4. Bisectability, at every commit of the stack: pytest collects every test file present at that
   commit (so each one imports) and runs the tests of the files that commit adds; at the last
   commit it runs the whole exported suite. (Reduced check: commit k runs only its own new test
   files, not those of commits < k again; the last commit runs all of them.)
5. At the last commit: `pretrain_hybrid.py --shared-prefix-packing --train-iters 20` trains, and
   the exported tools/check_kernel_determinism_coverage.py passes with --base-ref at the base
   commit.
6. `git am` of DIR/patches onto the base commit gives the same tree as the stack's last commit.

Prints the time of each step; exit status 0 when everything passes, 1 otherwise.
"""

import argparse
import os
import re
import shutil
import site
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import export_pr_stack  # noqa: E402  pylint: disable=wrong-import-position

ROOT = export_pr_stack.ROOT
FALLBACK_SIGNOFF = "pr-stack-check <pr-stack-check@localhost>"

# Deselects every collected test outside STACK_RUN_FILES; collection (and so the import of every
# test module present) still happens for all of them.
_RUN_ONLY_PLUGIN = '''
import os


def pytest_collection_modifyitems(config, items):
    run = set(os.environ["STACK_RUN_FILES"].split())
    keep = [item for item in items if item.nodeid.split("::")[0] in run]
    dropped = [item for item in items if item.nodeid.split("::")[0] not in run]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
    items[:] = keep
'''


class CheckFailed(Exception):
    """A step of the check failed; the message names it."""


def step(name, function, *args):
    start = time.monotonic()
    print(f"== {name}", flush=True)
    result = function(*args)
    print(f"   {name}: ok in {time.monotonic() - start:.1f} s", flush=True)
    return result


def isolated_python(work):
    """A venv interpreter with this environment's site-packages but none of its .pth hooks."""
    venv = work / "python"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    purelib = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    ours = {sysconfig.get_paths()["purelib"], *site.getsitepackages()}
    Path(purelib, "base_environment.pth").write_text("\n".join(sorted(ours)) + "\n")
    return python


def run(python, args, cwd, env, timeout, what, ok=(0,)):
    """Run ``python args``; on failure raise with the end of its stdout (pytest's summary)."""
    result = subprocess.run(
        [str(python), *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
    )
    if result.returncode not in ok:
        tail = "\n".join(result.stdout.strip().splitlines()[-150:])
        errors = "\n".join(result.stderr.strip().splitlines()[-20:])
        raise CheckFailed(f"{what} failed (exit {result.returncode}):\n{tail}\n{errors}")
    return result.stdout.strip()


def check_isolation(python, stack, env):
    probe = (
        "import importlib.util, megatron.core\n"
        "assert importlib.util.find_spec('megatron.shared_prefix') is None, 'extension importable'\n"
        f"assert megatron.core.__file__.startswith({str(stack)!r}), megatron.core.__file__\n"
    )
    run(python, ["-c", probe], stack, env, 300, "isolation probe")


def git(stack, *args):
    return subprocess.run(
        ["git", "-C", str(stack), *args], capture_output=True, text=True, check=True
    ).stdout


def bisect(python, stack, env, plugins):
    """Every commit: collect all tests present, run the new ones; the last commit: run all."""
    commits = git(stack, "rev-list", "--reverse", "HEAD").split()
    base, stack_commits = commits[0], commits[1:]
    pytest = [
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        "-p",
        "no:warnings",
        "tests/unit_tests",
    ]
    for index, commit in enumerate(stack_commits, 1):
        git(stack, "checkout", "-q", "--detach", commit)
        parent = commits[index - 1]
        added = git(stack, "diff", "--name-only", "--diff-filter=AM", parent, commit).split()
        tests = [p for p in added if Path(p).name.startswith("test_") and p.endswith(".py")]
        start = time.monotonic()
        if index == len(stack_commits):
            output = run(python, pytest, stack, env, 1800, f"full exported suite at PR {index}")
        else:
            run_env = dict(env, STACK_RUN_FILES=" ".join(tests))
            run_env["PYTHONPATH"] = f"{env['PYTHONPATH']}{os.pathsep}{plugins}"
            args = pytest + ["-p", "stack_run_only"]
            # Exit status 5: nothing selected, for a PR without test files of its own.
            ok = (0,) if tests else (0, 5)
            output = run(python, args, stack, run_env, 1200, f"tests of PR {index}", ok)
        summary = output.splitlines()[-1] if output else ""
        print(
            f"   PR {index}: {len(tests)} new test files; {summary} "
            f"({time.monotonic() - start:.1f} s)",
            flush=True,
        )
    return base


def check_training(python, stack, env, work):
    """20 iterations of the built-in tiny model; prints the first and last iteration's loss."""
    run_dir = work / "run"
    run_dir.mkdir()
    args = [str(stack / "pretrain_hybrid.py"), "--shared-prefix-packing", "--train-iters", "20"]
    result = subprocess.run(
        [str(python), *args], cwd=run_dir, env=env, capture_output=True, text=True, timeout=900
    )
    iterations = re.findall(r"iteration +(\d+)/ +20 .*?lm loss: ([0-9.E+-]+)", result.stdout)
    if result.returncode != 0 or not iterations or iterations[-1][0] != "20":
        tail = "\n".join((result.stdout + result.stderr).strip().splitlines()[-25:])
        raise CheckFailed(f"pretrain_hybrid.py --shared-prefix-packing failed:\n{tail}")
    (first, first_loss), (last, last_loss) = iterations[0], iterations[-1]
    print(
        f"   lm loss {float(first_loss):.4f} at iteration {first}, {float(last_loss):.4f} at {last}"
    )


def check_determinism(python, stack, env, base):
    args = ["tools/check_kernel_determinism_coverage.py", "--base-ref", base]
    print(
        "   " + run(python, args, stack, env, 300, "kernel determinism coverage").splitlines()[-1]
    )


def check_patches_apply(stack, base, work):
    applied = work / "am"
    git(stack, "worktree", "add", "-q", "--detach", str(applied), base)
    patches = sorted(str(p) for p in (stack / "patches").glob("*.patch"))
    env = dict(
        os.environ,
        GIT_COMMITTER_NAME="pr-stack-check",
        GIT_COMMITTER_EMAIL="pr-stack-check@localhost",
    )
    subprocess.run(
        ["git", "-C", str(applied), "am", "-q", *patches], env=env, check=True, capture_output=True
    )
    if git(applied, "rev-parse", "HEAD^{tree}") != git(stack, "rev-parse", "HEAD^{tree}"):
        raise CheckFailed("git am of patches/ onto the base differs from the stack's last commit")
    print(f"   {len(patches)} patches apply with git am and give the stack's tree")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--base", type=Path, help="Megatron-LM checkout (default: installed wheel)")
    parser.add_argument("--keep", type=Path, help="export here and keep it (default: a temp dir)")
    args = parser.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="pr-stack-"))
    stack = (args.keep or work / "stack").resolve()
    started = time.monotonic()
    try:
        step(
            "docs/upstreaming.md module map",
            export_pr_stack.check_docs,
            ROOT / "docs/upstreaming.md",
        )
        try:
            signoff = export_pr_stack.git_signoff(ROOT)
        except export_pr_stack.ExportError:
            signoff = FALLBACK_SIGNOFF
        base_dir = args.base or export_pr_stack.default_base()
        stats = step("export", export_pr_stack.export, stack, base_dir, ROOT, signoff)
        for number, stat in stats.items():
            print(f"   PR {number}: {export_pr_stack.stat_text(stat)}")
        python = step("isolated interpreter", isolated_python, work)
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
        env.update(PYTHONPATH=str(stack), TORCH_COMPILE_DISABLE="1", OMP_NUM_THREADS="1")
        step(
            "extension not importable, export first on the path",
            check_isolation,
            python,
            stack,
            env,
        )
        plugins = work / "plugins"
        plugins.mkdir()
        (plugins / "stack_run_only.py").write_text(_RUN_ONLY_PLUGIN)
        base = step("bisect: tests at every commit", bisect, python, stack, env, plugins)
        step("pretrain_hybrid.py --train-iters 20", check_training, python, stack, env, work)
        step("kernel determinism coverage", check_determinism, python, stack, env, base)
        step("git am of patches/", check_patches_apply, stack, base, work)
    except (CheckFailed, export_pr_stack.ExportError, subprocess.SubprocessError) as exc:
        print(f"check_pr_stack: FAILED: {exc}", file=sys.stderr)
        return 1
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    print(f"PR stack check passed in {time.monotonic() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
