"""Tests of tools/check_kernel_determinism_coverage.py on small temporary git repositories.

The checker runs as CI runs it, as a subprocess, and with `-I -S` (no site-packages, no
PYTHONPATH), which also proves that it needs nothing beyond the standard library. Each temporary
manifest is the real manifest with its ENTRIES replaced, so these tests exercise the real patterns.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
CHECKER = ROOT / "tools" / "check_kernel_determinism_coverage.py"
REAL_MANIFEST = ROOT / "tests" / "unit_tests" / "determinism" / "kernels" / "manifest.py"
MANIFEST = "tests/unit_tests/determinism/kernels/manifest.py"

# Commits need an identity; global and system git configuration must not leak into the tests.
GIT_ENV = {
    **os.environ,
    "GIT_CONFIG_NOSYSTEM": "1",
    "GIT_CONFIG_GLOBAL": os.devnull,
    "GIT_AUTHOR_NAME": "Test",
    "GIT_AUTHOR_EMAIL": "test@example.com",
    "GIT_COMMITTER_NAME": "Test",
    "GIT_COMMITTER_EMAIL": "test@example.com",
}

KERNEL_FILE = "megatron/shared_prefix/moe/counts.py"
KERNEL_CODE = '''"""Expert counts."""


def count(counts, experts, weights):
    counts.index_add_(0, experts, weights)
    return counts
'''
# The same kernel with different arithmetic: a code change, not a cosmetic one.
KERNEL_CODE_CHANGED = KERNEL_CODE.replace("weights)", "2 * weights)")
# Mentions kernels only in a docstring and a comment, so it must not count as kernel-bearing.
PROSE_FILE = "megatron/shared_prefix/layout.py"
PROSE_CODE = '''"""Unlike moe/counts.py, this calls neither index_add_ nor flex_attention."""

# torch.compile would not help here.
LAYOUT = "triton.jit"
'''
TEST_FILE = "tests/unit_tests/moe/test_counts_replay.py"
TEST_CODE = "def test_counts_replay():\n    pass\n"


def entry(sources=(KERNEL_FILE,), tests=(f"{TEST_FILE}::test_counts_replay",), exempt_reason=None):
    return (
        f"KernelEntry(name='expert_counts', sources={tuple(sources)!r}, tests={tuple(tests)!r}, "
        f"kind='order-sensitive PyTorch op', training_path=True, exempt_reason={exempt_reason!r})"
    )


class Repo:
    """A throwaway repository with one kernel file, one prose file, one test and a manifest."""

    def __init__(self, root):
        self.root = root
        root.mkdir()
        self.git("-c", "init.defaultBranch=main", "init", "-q")
        self.write(KERNEL_FILE, KERNEL_CODE)
        self.write(PROSE_FILE, PROSE_CODE)
        self.write(TEST_FILE, TEST_CODE)
        # Tests are not governed: a kernel here needs no registration.
        self.write("tests/unit_tests/test_probe.py", "@triton.jit\ndef k():\n    pass\n")
        self.set_entries(entry())

    def write(self, relative, text):
        path = self.root / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)

    def set_entries(self, *entries):
        body = "".join(f"    {e},\n" for e in entries)
        self.write(MANIFEST, REAL_MANIFEST.read_text() + f"\nENTRIES = [\n{body}]\n")

    def git(self, *args):
        subprocess.run(["git", *args], cwd=self.root, env=GIT_ENV, check=True, capture_output=True)

    def commit(self, message):
        self.git("add", "-A")
        self.git("commit", "-q", "-m", message)

    def check(self, *args, manifest=MANIFEST):
        result = subprocess.run(
            [sys.executable, "-I", "-S", str(CHECKER), "--repo-root", str(self.root)]
            + ["--manifest", str(self.root / manifest), *args],
            env=GIT_ENV,
            capture_output=True,
            text=True,
            timeout=60,
        )
        result.output = result.stdout + result.stderr
        return result


@pytest.fixture
def repo(tmp_path):
    return Repo(tmp_path / "repo")


def test_clean_repository_passes(repo):
    repo.commit("base")
    result = repo.check()
    assert result.returncode == 0, result.output
    assert "coverage OK (1 entries, 1 kernel-bearing files" in result.output


def test_unregistered_kernel_file_fails_and_names_the_line(repo):
    repo.set_entries()
    result = repo.check()
    assert result.returncode == 1, result.output
    expected = f"file {KERNEL_FILE} (line 5: order-sensitive accumulation)"
    assert f"unregistered kernel-bearing {expected}" in result.output
    assert PROSE_FILE not in result.output  # comments and strings do not count
    assert "test_probe" not in result.output  # tests/ is not governed


KERNEL_LINES = [
    "@triton.jit",
    "y = torch.compile(f)",
    "out = flex_attention(q, k, v, block_mask=mask)",
    "y = mamba_chunk_scan_combined(x, dt, A, B, C, chunk_size=64)",
    "def mamba_split_conv1d_scan_combined(zxbcdt, *args):",
    "y = causal_conv1d_fn(x, w, b)",
    "o = F.scaled_dot_product_attention(q, k, v)",
    "o = torch.ops.aten._efficient_attention_forward(q, k, v)",
    "from torch.nn.attention.varlen import varlen_attn",
    "out.scatter_add_(0, index, src)",
    "out.index_put_((rows, cols), values, accumulate=True)",
    "counts = torch.bincount(experts,\n    weights=multiplicity)",
    "tl.atomic_add(ptr, x)",
]


def test_each_kernel_pattern_makes_a_file_kernel_bearing(repo):
    # One file per pattern, checked in a single run to keep the test fast.
    for i, line in enumerate(KERNEL_LINES):
        repo.write(f"megatron/shared_prefix/extra_{i}.py", f"x = 1\n{line}\n")
    result = repo.check()
    assert result.returncode == 1, result.output
    for i, line in enumerate(KERNEL_LINES):
        reported = f"unregistered kernel-bearing file megatron/shared_prefix/extra_{i}.py (line 2:"
        assert reported in result.output, line


def test_ordinary_ops_are_not_kernel_bearing(repo):
    repo.write(
        "pretrain_hybrid.py",
        "import mamba_ssm.ops.triton.ssd_combined\n"
        "ssd.mamba_chunk_scan_combined = torch_ssd.mamba_chunk_scan_combined\n"
        "counts = torch.bincount(experts)\n"
        "x.index_put_((i,), v)\n"
        "y = torch.compiler.disable(f)\n",
    )
    result = repo.check()
    assert result.returncode == 0, result.output


def test_stale_source_path_fails(repo):
    repo.set_entries(entry(sources=(KERNEL_FILE, "megatron/shared_prefix/moe/gone.py")))
    result = repo.check()
    assert result.returncode == 1, result.output
    assert "source megatron/shared_prefix/moe/gone.py does not exist" in result.output


def test_stale_test_paths_fail(repo):
    repo.set_entries(
        entry(tests=("tests/unit_tests/moe/test_gone.py", f"{TEST_FILE}::test_renamed", "./t.py"))
    )
    result = repo.check()
    assert result.returncode == 1, result.output
    assert "test file tests/unit_tests/moe/test_gone.py does not exist" in result.output
    renamed = f"test {TEST_FILE}::test_renamed: test_renamed is not defined in {TEST_FILE}"
    assert renamed in result.output
    assert "'./t.py' is not a normalized repository-relative path" in result.output


@pytest.mark.parametrize(
    "reason, message",
    [
        ("", "exempt without a reason"),
        ("   ", "exempt without a reason"),
        (None, "has neither tests nor an exempt_reason"),
    ],
)
def test_entry_without_tests_needs_an_exempt_reason(repo, reason, message):
    repo.set_entries(entry(tests=(), exempt_reason=reason))
    result = repo.check()
    assert result.returncode == 1, result.output
    assert f"entry 'expert_counts': {message}" in result.output


def test_exempt_entry_with_a_reason_passes_and_is_only_noted_when_changed(repo):
    repo.set_entries(entry(tests=(), exempt_reason="integer weights: exact in any order"))
    repo.commit("base")
    repo.write(KERNEL_FILE, KERNEL_CODE_CHANGED)
    result = repo.check("--base-ref", "HEAD")
    assert result.returncode == 0, result.output
    assert "exempt: integer weights: exact in any order" in result.output


def test_source_changed_without_test_change_fails(repo):
    repo.commit("base")
    repo.write(KERNEL_FILE, KERNEL_CODE_CHANGED)
    uncommitted = repo.check("--base-ref", "HEAD")
    repo.commit("change the kernel only")
    committed = repo.check("--base-ref", "HEAD~1")
    for result in (uncommitted, committed):
        assert result.returncode == 1, result.output
        assert f"{KERNEL_FILE} changed but none of its tests did ({TEST_FILE})" in result.output


def test_source_changed_with_a_test_change_passes(repo):
    repo.commit("base")
    repo.write(KERNEL_FILE, KERNEL_CODE_CHANGED)
    repo.write(TEST_FILE, TEST_CODE + "\n\ndef test_counts_replay_bf16():\n    pass\n")
    result = repo.check("--base-ref", "HEAD")
    assert result.returncode == 0, result.output


def test_comment_docstring_and_formatting_changes_need_no_test_change(repo):
    repo.commit("base")
    cosmetic = (
        KERNEL_CODE.replace('"""Expert counts."""', '"""Expert counts,\nrewrapped."""')
        .replace(
            "def count(counts, experts, weights):", "def count(\n    counts, experts, weights\n):"
        )
        .replace("    return counts", "    # counts now holds the sums\n    return counts")
    )
    repo.write(KERNEL_FILE, cosmetic)
    result = repo.check("--base-ref", "HEAD")
    assert result.returncode == 0, result.output
    assert f"{KERNEL_FILE} changed in comments, docstrings or formatting only" in result.output
    repo.write(KERNEL_FILE, cosmetic.replace("weights)", "weights.neg())"))
    assert repo.check("--base-ref", "HEAD").returncode == 1


def test_new_untracked_test_file_counts_as_a_test_change(repo):
    repo.commit("base")
    new_test = "tests/unit_tests/moe/test_counts_gpu_replay.py"
    repo.write(new_test, TEST_CODE)
    repo.write(KERNEL_FILE, KERNEL_CODE_CHANGED)
    repo.set_entries(entry(tests=(f"{TEST_FILE}::test_counts_replay", new_test)))
    result = repo.check("--base-ref", "HEAD")
    assert result.returncode == 0, result.output


def test_no_require_test_update_turns_the_failure_into_a_note(repo):
    repo.commit("base")
    repo.write(KERNEL_FILE, KERNEL_CODE_CHANGED)
    result = repo.check("--base-ref", "HEAD", "--no-require-test-update")
    assert result.returncode == 0, result.output
    assert "changed but none of its tests did" in result.output
    assert "allowed by --no-require-test-update" in result.output


def test_nonexistent_base_ref_is_noted_and_skips_only_the_change_check(repo):
    repo.commit("first and only commit")
    result = repo.check("--base-ref", "HEAD~1")
    assert result.returncode == 0, result.output
    assert "--base-ref HEAD~1 is not a commit in this repository" in result.output
    # The other rules still apply.
    repo.set_entries()
    result = repo.check("--base-ref", "HEAD~1")
    assert result.returncode == 1, result.output
    assert "unregistered kernel-bearing file" in result.output


def test_environment_errors_exit_with_status_2(repo, tmp_path):
    not_a_repo = tmp_path / "plain"
    not_a_repo.mkdir()
    result = subprocess.run(
        [sys.executable, "-I", "-S", str(CHECKER), "--repo-root", str(not_a_repo)]
        + ["--manifest", str(repo.root / MANIFEST), "--base-ref", "HEAD"],
        env=GIT_ENV,
        capture_output=True,
        text=True,
    )
    assert result.returncode == 2, result.stdout + result.stderr
    assert "git rev-parse --git-dir failed" in result.stderr
    empty_ref = repo.check("--base-ref", "")
    assert empty_ref.returncode == 2 and "--base-ref is empty" in empty_ref.output
    missing = repo.check(manifest="no/such/manifest.py")
    assert missing.returncode == 2 and "manifest not found" in missing.output
    repo.write("broken_manifest.py", "ENTRIES = [\n")
    broken = repo.check(manifest="broken_manifest.py")
    assert broken.returncode == 2 and "cannot load manifest" in broken.output


def test_help_documents_rules_and_exit_codes():
    result = subprocess.run(
        [sys.executable, "-I", "-S", str(CHECKER), "--help"], capture_output=True, text=True
    )
    assert result.returncode == 0
    for text in ("Rules", "--base-ref", "--no-require-test-update", "Exit status: 0", "2 usage"):
        assert text in result.stdout
