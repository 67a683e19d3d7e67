"""Tests of tools/export_pr_stack.py: the map covers every file, anchors fail loudly, the rewritten
tree holds no megatron.shared_prefix, and an export against the installed megatron-core is a stack
of eight commits with their patches."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "tools"))

import export_pr_stack  # noqa: E402  pylint: disable=wrong-import-position
import pr_stack_map  # noqa: E402  pylint: disable=wrong-import-position


def test_every_file_of_this_repository_is_in_the_map():
    plan = export_pr_stack.plan_export(export_pr_stack.source_files(ROOT))
    targets = {f.target for f in plan.files}
    assert "megatron/core/models/hybrid/shared_prefix/planning.py" in targets
    assert "tests/unit_tests/determinism/kernels/manifest.py" in targets
    assert not any("megatron/shared_prefix" in t for t in targets)


def test_an_unmapped_file_fails_naming_it():
    with pytest.raises(export_pr_stack.ExportError) as error:
        export_pr_stack.plan_export(
            ["megatron/shared_prefix/layout.py", "megatron/shared_prefix/speculative_decoding.py"]
        )
    assert "megatron/shared_prefix/speculative_decoding.py" in str(error.value)
    assert "tools/pr_stack_map.py" in str(error.value)


def test_a_directory_rule_places_files_added_later():
    plan = export_pr_stack.plan_export(["megatron/shared_prefix/ssm/new_kernel.py"])
    (exported,) = plan.files
    assert exported.target == "megatron/core/ssm/shared_prefix/new_kernel.py"
    assert exported.pr == 3


def test_missing_anchor_names_the_file_and_the_anchor(tmp_path):
    edit = next(e for e in pr_stack_map.UPSTREAM_EDITS if e.path.endswith("hybrid_model.py"))
    target = tmp_path / edit.path
    target.parent.mkdir(parents=True)
    target.write_text("class HybridModel:\n    def forward(self, input_ids):\n        pass\n")
    with pytest.raises(export_pr_stack.ExportError) as error:
        export_pr_stack.apply_edit(tmp_path, edit)
    message = str(error.value)
    assert message.startswith("megatron/core/models/hybrid/hybrid_model.py: anchor ")
    assert repr(edit.anchor) in message
    assert "found 0 times" in message


def test_a_file_that_the_base_lacks_is_created_only_where_the_map_allows(tmp_path):
    pretrain = next(e for e in pr_stack_map.UPSTREAM_EDITS if e.path == "pretrain_hybrid.py")
    export_pr_stack.apply_edit(tmp_path, pretrain)
    hook = (tmp_path / pretrain.path).read_text()
    # mamba_ssm's mode is set before the import that loads its kernels.
    entry = hook.index("from megatron.training.shared_prefix.pretrain import main")
    assert 0 <= hook.index('os.environ.setdefault("MAMBA_DETERMINISTIC", "1")') < entry
    model = next(e for e in pr_stack_map.UPSTREAM_EDITS if e.path.endswith("hybrid_model.py"))
    with pytest.raises(export_pr_stack.ExportError, match="hybrid_model.py: not in the base"):
        export_pr_stack.apply_edit(tmp_path, model)


def test_rewriting_maps_modules_and_paths_to_their_upstream_homes():
    plan = export_pr_stack.plan_export(export_pr_stack.source_files(ROOT))
    text = (
        "from megatron.shared_prefix.ssm.tree_scan import tree_ssd_scan\n"
        "from megatron.shared_prefix import plan_shared_prefix\n"
        "import megatron.shared_prefix.models.hybrid.hybrid_layer_specs\n"
        'SOURCE = "megatron/shared_prefix/attention/flex_backend.py"\n'
    )
    assert export_pr_stack.rewrite_names(text, plan, "test") == (
        "from megatron.core.ssm.shared_prefix.tree_scan import tree_ssd_scan\n"
        "from megatron.core.models.hybrid.shared_prefix import plan_shared_prefix\n"
        "import megatron.core.models.hybrid.shared_prefix.hybrid_layer_specs\n"
        'SOURCE = "megatron/core/transformer/tree_attention/flex_backend.py"\n'
    )


def test_an_import_of_a_later_pr_fails_the_export():
    plan = export_pr_stack.plan_export(export_pr_stack.source_files(ROOT))
    texts = {
        "megatron/core/models/hybrid/shared_prefix/layout.py": (
            1,
            "def f():\n    from megatron.core.ssm.shared_prefix import tree_scan\n",
        )
    }
    with pytest.raises(export_pr_stack.ExportError, match="would not bisect") as error:
        export_pr_stack.check_import_order(texts, plan)
    assert "which PR 3 adds" in str(error.value)


def test_docs_module_map_is_generated_from_the_map():
    export_pr_stack.check_docs(ROOT / "docs" / "upstreaming.md")
    for rule in pr_stack_map.RULES:
        assert f"`{rule.source}`" in export_pr_stack.module_map_markdown()


def test_export_against_the_installed_megatron_core(tmp_path):
    out = tmp_path / "stack"
    stats = export_pr_stack.export(
        out, export_pr_stack.default_base(), ROOT, signoff="Test <test@example.com>"
    )
    assert sorted(stats) == [pr.number for pr in pr_stack_map.PULL_REQUESTS]
    log = subprocess.run(
        ["git", "-C", str(out), "log", "--format=%s%n%b%x00"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split("\0")
    messages = [m.strip() for m in log if m.strip()]
    assert len(messages) == 1 + len(pr_stack_map.PULL_REQUESTS)
    assert messages[-1].startswith("Base: megatron-core 0.19.2")
    for message in messages[:-1]:
        for section in ("Summary", "Dependencies", "Validation", "Known limitations"):
            assert f"\n{section}\n" in message
        assert message.endswith("Signed-off-by: Test <test@example.com>")
    patches = sorted(p.name for p in (out / "patches").glob("*.patch"))
    assert len(patches) == len(pr_stack_map.PULL_REQUESTS) and patches[0].startswith("0001-")
    grep = subprocess.run(
        ["git", "-C", str(out), "grep", "-n", "-E", r"megatron[./]shared_prefix"],
        capture_output=True,
        text=True,
    )
    assert grep.returncode == 1, grep.stdout
    model = (out / "megatron/core/models/hybrid/hybrid_model.py").read_text()
    assert "shared_prefix_layout=None," in model and "return forest_forward(" in model
    # In-place edits stay a small share of every PR.
    assert all(stat.fraction < 0.05 for stat in stats.values())
    # The exported manifest names the exported sources and tests: its checker passes there.
    base = subprocess.run(
        ["git", "-C", str(out), "rev-list", "--max-parents=0", "HEAD"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    coverage = subprocess.run(
        [sys.executable, "tools/check_kernel_determinism_coverage.py", "--base-ref", base],
        cwd=out,
        capture_output=True,
        text=True,
    )
    assert coverage.returncode == 0, coverage.stdout + coverage.stderr


def test_imports_pushed_past_the_line_length_are_wrapped_as_black_does():
    line = "from tests.unit_tests.models.hybrid.shared_prefix.dense_reference import first, second"
    long = line + ", third_name_that_is_long  # noqa: E402"
    assert export_pr_stack.wrap_long_imports(line) == line
    assert export_pr_stack.wrap_long_imports(long).split("\n") == [
        "from tests.unit_tests.models.hybrid.shared_prefix.dense_reference import (  # noqa: E402",
        "    first,",
        "    second,",
        "    third_name_that_is_long,",
        ")",
    ]


def test_the_check_interpreter_cannot_import_this_repository(tmp_path):
    import check_pr_stack  # pylint: disable=import-outside-toplevel

    python = check_pr_stack.isolated_python(tmp_path)
    probe = (
        "import importlib.util, torch, megatron.core\n"
        "print(importlib.util.find_spec('megatron.shared_prefix') is None)\n"
    )
    # This environment's site-packages hold the editable install of this repository; only its
    # finder (a .pth hook) makes megatron.shared_prefix importable, and the interpreter skips it.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    result = subprocess.run(
        [str(python), "-c", probe],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "True"
