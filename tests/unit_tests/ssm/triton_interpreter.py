"""Run a test file's own checks under Triton's interpreter, on CPU.

TRITON_INTERPRET=1 must be set before triton compiles anything in the process, so the checks run in
a subprocess: the test file runs itself as a script.
"""

import os
import subprocess
import sys


def run_interpreted(script, *args, timeout: int = 600) -> str:
    """Standard output of ``python script *args`` under TRITON_INTERPRET=1; the calling test fails
    with the subprocess's output when it exits non-zero."""
    result = subprocess.run(
        [sys.executable, str(script), *map(str, args)],
        env={**os.environ, "TRITON_INTERPRET": "1"},
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout
