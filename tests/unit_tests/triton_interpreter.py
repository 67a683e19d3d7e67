"""Triton helpers of the tests: a test file's own checks under Triton's interpreter, on CPU
(``run_interpreted``), and the kernels compiled inside a block (``triton_compiles``).

TRITON_INTERPRET=1 must be set before triton compiles anything in the process, so the checks run in
a subprocess: the test file runs itself as a script, with tests/unit_tests importable as under
pytest (pyproject.toml's ``pythonpath``).
"""

import contextlib
import os
import subprocess
import sys
from pathlib import Path

UNIT_TESTS = Path(__file__).resolve().parent


def run_interpreted(script, *args, timeout: int = 600) -> str:
    """Standard output of ``python script *args`` under TRITON_INTERPRET=1; the calling test fails
    with the subprocess's output when it exits non-zero."""
    result = subprocess.run(
        [sys.executable, str(script), *map(str, args)],
        env={
            **os.environ,
            "TRITON_INTERPRET": "1",
            "PYTHONPATH": os.pathsep.join(
                filter(None, [str(UNIT_TESTS), os.environ.get("PYTHONPATH")])
            ),
        },
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


@contextlib.contextmanager
def triton_compiles():
    """Names of the Triton JIT kernels (``@triton.jit``) compiled inside the block: each new
    variant of a kernel, in-memory cache misses (Inductor's kernels do not go through it)."""
    import triton  # pylint: disable=import-outside-toplevel

    compiled = []

    def hook(*, fn, **_):
        compiled.append(fn.name)
        return False  # compile and launch as usual

    runtime = triton.knobs.runtime
    previous = runtime.jit_cache_hook
    runtime.jit_cache_hook = hook
    try:
        yield compiled
    finally:
        runtime.jit_cache_hook = previous
