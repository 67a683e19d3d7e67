"""tools/record_checkpoint_integrity.py: adopt a checkpoint saved without a record, verify one."""

import importlib.util
import os
from pathlib import Path

import pytest

from megatron.shared_prefix.training.integrity import (
    TRACKER_NAME,
    CheckpointError,
    iteration_to_load,
)

TOOL = Path(__file__).resolve().parents[3] / "tools" / "record_checkpoint_integrity.py"


def load_tool():
    spec = importlib.util.spec_from_file_location("record_checkpoint_integrity", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_records_an_unrecorded_checkpoint_then_verifies_it(tmp_path, capsys):
    tool = load_tool()
    directory = str(tmp_path)
    os.makedirs(tmp_path / "iter_0000007")
    (tmp_path / "iter_0000007" / "model_optim_rng.pt").write_bytes(b"state" * 10)
    (tmp_path / TRACKER_NAME).write_text("7")
    with pytest.raises(CheckpointError) as error:
        iteration_to_load(directory)
    assert str(error.value).endswith(
        f"python tools/record_checkpoint_integrity.py {directory} --iteration 7"
    )

    assert tool.main([directory]) == 0
    assert "recorded" in capsys.readouterr().out
    assert iteration_to_load(directory) == 7

    (tmp_path / "iter_0000007" / "model_optim_rng.pt").write_bytes(b"State" * 10)
    assert tool.main([directory, "--iteration", "7"]) == 1  # verified, never rewritten
    assert "does not match its checksum" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        tool.main([directory, "--iteration", "8"])
