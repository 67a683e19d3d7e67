"""Checkpoint integrity records: writing, verification, refusal of damaged checkpoints on load,
the megatron.training save hook, and resumption after a kill at any point of a save."""

import argparse
import json
import multiprocessing
import os
import shutil
import signal

import numpy as np
import pytest
import torch

from megatron.shared_prefix.training import integrity
from megatron.shared_prefix.training.config import ConfigError
from megatron.shared_prefix.training.integrity import (
    RECORD_NAME,
    TRACKER_NAME,
    CheckpointError,
    intact_iterations,
    iteration_to_load,
    verify_iteration,
    write_integrity_record,
)
from megatron.shared_prefix.training.megatron_integration import (
    verify_load_directory,
    with_integrity_records,
)

FAST = ("--hybrid-layer-pattern", "*-E")


def megatron_like_save(directory, iteration, payload=b"weights"):
    """The files of a torch_dist checkpoint of Megatron (shards, common state, metadata), the
    tracker written last, as Megatron's save_checkpoint leaves them."""
    root = os.path.join(directory, f"iter_{iteration:07d}")
    os.makedirs(os.path.join(root, "nested"), exist_ok=True)
    for name, content in (
        ("__0_0.distcp", payload * 50),
        ("__1_0.distcp", payload[::-1] * 50),
        ("common.pt", b"common"),
        ("metadata.json", b'{"sharded_backend": "torch_dist"}'),
        (".metadata", b"meta"),
        ("nested/extra_state.pt", b"extra"),
    ):
        with open(os.path.join(root, name), "wb") as handle:
            handle.write(content)
    with open(os.path.join(directory, TRACKER_NAME), "w") as tracker:
        tracker.write(str(iteration))
    return root


def saved_tensors(root):
    """Every tensor of a distributed checkpoint (weights and optimizer moments) by its key."""
    from megatron.core.dist_checkpointing import load_plain_tensors

    return {k: v for k, v in load_plain_tensors(root).items() if isinstance(v, torch.Tensor)}


def flip_bytes(path, count=100, seed=0):
    data = bytearray(open(path, "rb").read())
    for index in np.random.default_rng(seed).choice(len(data), size=count, replace=False):
        data[index] ^= 0xFF
    open(path, "wb").write(bytes(data))


def test_record_covers_every_file_and_finds_any_damage(tmp_path):
    directory = str(tmp_path)
    root = megatron_like_save(directory, 10)
    write_integrity_record(root, 10)
    record = json.load(open(os.path.join(root, RECORD_NAME)))
    assert sorted(record["files"]) == [
        ".metadata",
        "__0_0.distcp",
        "__1_0.distcp",
        "common.pt",
        "metadata.json",
        "nested/extra_state.pt",
    ]
    assert verify_iteration(directory, 10) is None and iteration_to_load(directory) == 10

    flip_bytes(os.path.join(root, "__1_0.distcp"), count=3)
    problem = verify_iteration(directory, 10)
    assert problem.endswith(
        "__1_0.distcp does not match its checksum in " "shared_prefix_integrity.json (corrupted)"
    )
    # Ranks hash disjoint shares of the files: exactly one of two ranks finds the flipped bytes.
    found = [verify_iteration(directory, 10, shard=(rank, 2)) for rank in range(2)]
    assert sum(p is not None for p in found) == 1

    os.truncate(os.path.join(root, "common.pt"), 2)
    for rank in range(2):  # sizes are checked by every rank
        assert "common.pt has 2 bytes, its integrity record 6" in verify_iteration(
            directory, 10, shard=(rank, 2)
        )
    os.remove(os.path.join(root, "common.pt"))
    assert verify_iteration(directory, 10).endswith("common.pt is missing")


def test_missing_record_means_an_unfinished_save(tmp_path):
    directory = str(tmp_path)
    write_integrity_record(megatron_like_save(directory, 5), 5)
    megatron_like_save(directory, 10)  # tracker says 10, its record was never written
    assert intact_iterations(directory) == [5]
    with pytest.raises(CheckpointError) as error:
        iteration_to_load(directory)
    message = str(error.value)
    assert "the checkpoint of iteration 10 (latest_checkpointed_iteration.txt) is not intact" in (
        message
    )
    assert f"{RECORD_NAME} is missing (the save of iteration 10 did not finish)" in message
    assert f"resume from it with --load {directory} --ckpt-step 5" in message
    assert iteration_to_load(directory, step=5) == 5


def test_no_tracker_means_nothing_to_load(tmp_path):
    assert iteration_to_load(str(tmp_path)) is None
    with pytest.raises(CheckpointError, match="iteration 3 .*iter_0000003 does not exist"):
        iteration_to_load(str(tmp_path), step=3)


class FakeMegatronCheckpointing:
    """What with_integrity_records relies on in megatron.training's save_checkpoint: every file
    of the iteration is written, then rank 0 asks get_checkpoint_tracker_filename for the tracker
    and writes it (as megatron-core 0.19.2 does after its barrier)."""

    def __init__(self, directory, calls_tracker_filename=True):
        self.directory = directory
        self.calls_tracker_filename = calls_tracker_filename
        self.record_existed_at_tracker_write = []

    @staticmethod
    def get_checkpoint_tracker_filename(checkpoints_path):
        return os.path.join(checkpoints_path, TRACKER_NAME)

    def save_checkpoint(self, iteration, model, optimizer, scheduler, flops, **kwargs):
        if kwargs.get("non_persistent_ckpt"):
            return
        root = megatron_like_save(self.directory, iteration)
        os.remove(os.path.join(self.directory, TRACKER_NAME))
        tracker = os.path.join(self.directory, TRACKER_NAME)
        if self.calls_tracker_filename:
            tracker = self.get_checkpoint_tracker_filename(self.directory)
        self.record_existed_at_tracker_write.append(os.path.isfile(os.path.join(root, RECORD_NAME)))
        with open(tracker, "w") as handle:
            handle.write(str(iteration))


def test_megatron_saves_record_before_the_tracker_and_loads_are_verified(megatron_world, tmp_path):
    directory = str(tmp_path / "ckpt")
    megatron = FakeMegatronCheckpointing(directory)
    original = megatron.get_checkpoint_tracker_filename
    save = with_integrity_records(megatron.save_checkpoint, megatron)
    save(4, None, None, None, 0.0, checkpointing_context={})
    save(8, None, None, None, 0.0, non_persistent_ckpt=True)
    assert megatron.record_existed_at_tracker_write == [True]
    assert megatron.get_checkpoint_tracker_filename is original  # restored after the save
    assert intact_iterations(directory) == [4]

    args = argparse.Namespace(load=directory, ckpt_step=None)
    assert verify_load_directory(args) == 4
    flip_bytes(os.path.join(directory, "iter_0000004", "__0_0.distcp"), count=1)
    with pytest.raises(CheckpointError, match="__0_0.distcp does not match its checksum"):
        verify_load_directory(args)
    assert verify_load_directory(argparse.Namespace(load=None, ckpt_step=None)) is None


def test_pretrained_checkpoint_is_verified_when_load_holds_none(tmp_path):
    """Megatron loads --pretrained-checkpoint (as --finetune) when --load holds no checkpoint;
    that directory is verified the same way, and named in the error."""
    pretrained = str(tmp_path / "pretrained")
    write_integrity_record(megatron_like_save(pretrained, 6), 6)
    empty = str(tmp_path / "empty")
    os.makedirs(empty)
    args = argparse.Namespace(load=empty, ckpt_step=None, pretrained_checkpoint=pretrained)
    assert verify_load_directory(args) == 6
    flip_bytes(os.path.join(pretrained, "iter_0000006", "__1_0.distcp"), count=1)
    with pytest.raises(CheckpointError, match=f"^--pretrained-checkpoint {pretrained}: the check"):
        verify_load_directory(args)
    os.remove(os.path.join(pretrained, TRACKER_NAME))
    with pytest.raises(ConfigError, match="no checkpoint there"):
        verify_load_directory(args)


def test_megatron_save_without_the_tracker_call_is_recorded_after_it(megatron_world, tmp_path):
    from megatron.training.global_vars import set_args

    directory = str(tmp_path / "ckpt")
    megatron = FakeMegatronCheckpointing(directory, calls_tracker_filename=False)
    set_args(argparse.Namespace(save=directory))
    try:
        with_integrity_records(megatron.save_checkpoint, megatron)(3, None, None, None, 0.0)
    finally:
        set_args(None)
    assert megatron.record_existed_at_tracker_write == [False]
    assert intact_iterations(directory) == [3]


@pytest.fixture
def two_checkpoints(train, tmp_path):
    """A run of 2 iterations saved at both; returns (history, checkpoint directory)."""
    save = str(tmp_path / "ckpt")
    history, _ = train(*FAST, "--train-iters", "2", "--save", save, "--save-interval", "1")
    assert intact_iterations(save) == [1, 2]
    return history, save


SHARDS = "__0_0.distcp"  # the tensors of megatron's distributed save (rank 0's file)

DAMAGE = {
    "flipped bytes": (
        lambda root: flip_bytes(os.path.join(root, SHARDS)),
        f"{SHARDS} does not match its checksum",
    ),
    "truncated": (
        lambda root: os.truncate(
            os.path.join(root, SHARDS), os.path.getsize(os.path.join(root, SHARDS)) // 2
        ),
        "(truncated or rewritten)",
    ),
    "zero-length": (
        lambda root: os.truncate(os.path.join(root, SHARDS), 0),
        f"{SHARDS} has 0 bytes",
    ),
    "deleted iteration": (shutil.rmtree, "iter_0000002 does not exist"),
    "no record": (
        lambda root: os.remove(os.path.join(root, RECORD_NAME)),
        "the save of iteration 2 did not finish",
    ),
}


def test_damaged_latest_checkpoint_stops_before_any_state_changes(two_checkpoints, train, tmp_path):
    history, save = two_checkpoints
    metrics = (tmp_path / "metrics.jsonl").read_bytes()
    for kind, (damage, problem) in DAMAGE.items():
        broken = str(tmp_path / kind.replace(" ", "_"))
        shutil.copytree(save, broken)
        damage(os.path.join(broken, "iter_0000002"))
        listing = sorted(os.listdir(broken))
        with pytest.raises(CheckpointError) as error:
            train(
                *FAST,
                "--train-iters",
                "3",
                "--load",
                broken,
                "--save",
                broken,
                "--save-interval",
                "1",
            )
        message = str(error.value)
        assert message.startswith(f"--load {broken}: the checkpoint of iteration 2"), kind
        assert problem in message, kind
        assert f"resume from it with --load {broken} --ckpt-step 1" in message, kind
        assert sorted(os.listdir(broken)) == listing, kind  # nothing written
        assert (tmp_path / "metrics.jsonl").read_bytes() == metrics, kind

    resumed, lines = train(*FAST, "--train-iters", "2", "--load", broken, "--ckpt-step", "1")
    assert any("resumed from" in line and "iteration 1" in line for line in lines)
    assert [(m.loss, m.grad_norm) for m in resumed] == [(m.loss, m.grad_norm) for m in history[1:]]


@pytest.fixture(scope="module")
def forkserver():
    """A multiprocessing forkserver that imported fault_injection.py (and with it the trainer) once.

    Forking the test process itself is not safe once autograd's worker threads exist in it. This
    Python's forkserver does not take the parent's sys.path, so the server finds fault_injection
    through PYTHONPATH, set while it starts.
    """
    from multiprocessing import forkserver as server

    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["fault_injection"])
    here = os.path.dirname(os.path.abspath(__file__))
    saved = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (here, saved) if p)
    try:
        server.ensure_running()
    finally:
        if saved is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = saved
    return context


def kill_during_save(context, argv, point, rng):
    """Train in a child process that SIGKILLs itself at ``point`` of the save of a random iteration
    (fault_injection.py); returns that iteration."""
    import fault_injection

    iteration = int(rng.integers(1, 4))
    child = context.Process(
        target=fault_injection.train_and_kill,
        args=(argv, point, iteration, float(rng.uniform(0.05, 0.95))),
    )
    child.start()
    child.join(timeout=300)
    assert child.exitcode == -signal.SIGKILL, (point, child.exitcode)
    return iteration


def test_kill_at_any_point_of_a_save_resumes_bit_identically(train, tmp_path, forkserver):
    """Kill -9 at every point of a save (at a random iteration, a random cut of the file); the next
    run with --load = --save resumes from the newest intact checkpoint, and its trajectory and
    final weights are bit-identical to an uninterrupted run's."""
    reference_dir = str(tmp_path / "reference")
    common = (*FAST, "--train-iters", "4", "--save-interval", "1")
    reference, _ = train(*common, "--save", reference_dir)
    expected = saved_tensors(os.path.join(reference_dir, "iter_0000004"))
    from fault_injection import KILL_POINTS

    rng = np.random.default_rng(17)
    for number, point in enumerate(KILL_POINTS):
        save = str(tmp_path / f"run{number}")
        argv = [
            *common,
            "--global-batch-size",
            "8",
            "--lr-warmup-iters",
            "0",
            "--shared-prefix-metrics-jsonl",
            str(tmp_path / f"metrics{number}.jsonl"),
            "--save",
            save,
            "--load",
            save,
        ]
        killed_in = kill_during_save(forkserver, argv, point, rng)
        completed = killed_in - 1  # the tracker still names the save before the killed one
        assert (integrity.tracked_iteration(save) or 0) == completed, point
        resumed, _ = train(*argv)
        assert [m.iteration for m in resumed] == list(range(completed + 1, 5)), point
        assert [(m.loss, m.grad_norm) for m in resumed] == [
            (m.loss, m.grad_norm) for m in reference[completed:]
        ], point
        final = saved_tensors(os.path.join(save, "iter_0000004"))
        assert final.keys() == expected.keys()
        for name, tensor in expected.items():
            assert torch.equal(final[name], tensor), (point, name)
        records = [json.loads(line) for line in open(tmp_path / f"metrics{number}.jsonl")]
        assert [r["iteration"] for r in records] == [1, 2, 3, 4], point
        assert intact_iterations(save)[-1] == 4, point
