"""megatron.shared_prefix installs as a portion of the `megatron` namespace next to megatron-core."""

import os
import subprocess
import sys
import zipfile

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
IMPORT_BOTH = (
    "import megatron.core, megatron.shared_prefix as sp\n"
    "print(sp.__file__)\n"
    "assert sp.plan_shared_prefix and sp.SharedPrefixHybridModel and sp.hybrid_stack_spec and sp.enable_cpu\n"
)


def test_namespace_package_has_no_init():
    assert not os.path.exists(os.path.join(REPO, "megatron", "__init__.py"))


def test_built_wheel_imports_next_to_megatron_core(tmp_path):
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(tmp_path),
            REPO,
        ],
        check=True,
        capture_output=True,
    )
    (wheel,) = tmp_path.glob("megatron_shared_prefix-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "megatron/shared_prefix/__init__.py" in names
    assert "megatron/shared_prefix/models/hybrid/hybrid_model.py" in names
    assert "megatron/__init__.py" not in names
    target = tmp_path / "site"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-deps",
            "--target",
            str(target),
            str(wheel),
        ],
        check=True,
        capture_output=True,
    )
    # Run outside the repository so that only the installed wheel can provide megatron.shared_prefix.
    env = dict(os.environ, PYTHONPATH=str(target), TORCH_COMPILE_DISABLE="1")
    result = subprocess.run(
        [sys.executable, "-c", IMPORT_BOTH],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().startswith(str(target))


def test_editable_install_imports_next_to_megatron_core(tmp_path):
    """The test environment itself is the editable install (`make test` runs `pip install -e`)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["TORCH_COMPILE_DISABLE"] = "1"
    result = subprocess.run(
        [sys.executable, "-c", IMPORT_BOTH],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().startswith(os.path.join(REPO, "megatron"))
