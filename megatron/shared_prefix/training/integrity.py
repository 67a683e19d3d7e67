"""Integrity records of checkpoints: a checksum per file, written after every file of a save.

A checkpoint directory follows Megatron's layout, for both trainers::

    <dir>/latest_checkpointed_iteration.txt     the latest finished iteration
    <dir>/iter_0000300/...                      the files of iteration 300 (any tree of files)
    <dir>/iter_0000300/shared_prefix_integrity.json

The record lists every other file under ``iter_XXXXXXX/`` with its size and SHA-256. It is written
once all of them are complete, so a missing record means an unfinished save, and a file that
differs from its record (flipped bytes, truncation, deletion) is found before anything is loaded.
Loading checks the iteration the tracker (or ``--ckpt-step``) names; when it is not intact, the
error names the bad file and the newest intact iteration, and how to load that one. Nothing is
loaded, written or trained before that check passes.

A file is checked by streaming it through SHA-256 (about 1 GB/s per core). Under
megatron.training every rank checks its share of the files (:func:`verify_iteration`'s ``shard``),
so a large sharded checkpoint is read once in total.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from typing import Optional

from megatron.shared_prefix.training.config import ConfigError

__all__ = [
    "RECORD_NAME",
    "TRACKER_NAME",
    "CheckpointError",
    "iteration_dir",
    "write_integrity_record",
    "verify_iteration",
    "intact_iterations",
    "tracked_iteration",
    "iteration_to_load",
]

RECORD_NAME = "shared_prefix_integrity.json"
TRACKER_NAME = "latest_checkpointed_iteration.txt"
_FORMAT = 1
_ITERATION_DIR = re.compile(r"^iter_(\d{7,})$")
_CHUNK = 1 << 20


class CheckpointError(ConfigError):
    """A checkpoint that ``--load`` names cannot be loaded as it is; the message says what to do."""


def iteration_dir(directory: str, iteration: int) -> str:
    """``directory/iter_XXXXXXX``, Megatron's name for the files of ``iteration``."""
    return os.path.join(directory, f"iter_{iteration:07d}")


def _sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(_CHUNK), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _files(root: str) -> list[str]:
    """Every file under ``root`` except the record, as sorted '/'-separated relative paths."""
    found = []
    for folder, _, names in os.walk(root):
        for name in names:
            relative = os.path.relpath(os.path.join(folder, name), root).replace(os.sep, "/")
            if relative != RECORD_NAME:
                found.append(relative)
    return sorted(found)


def write_atomically(path: str, text: str) -> None:
    """Write ``text`` to ``path`` through a synced temporary file and a rename."""
    temporary = path + ".tmp"
    with open(temporary, "w", encoding="utf-8") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(temporary, path)


def write_integrity_record(root: str, iteration: int) -> str:
    """Record size and SHA-256 of every file under ``root`` (an ``iter_XXXXXXX`` directory).

    Call it after every file of the save is complete and before the tracker names the iteration.
    Temporary files (``*.tmp``) left by an interrupted earlier attempt are not recorded.

    Returns:
        The record's path.
    """
    files = {}
    for relative in _files(root):
        if relative.endswith(".tmp"):
            continue
        path = os.path.join(root, relative)
        files[relative] = {"size": os.path.getsize(path), "sha256": _sha256(path)}
    record = {"format": _FORMAT, "iteration": iteration, "files": files}
    path = os.path.join(root, RECORD_NAME)
    write_atomically(path, json.dumps(record, indent=1, sort_keys=True) + "\n")
    return path


def _read_record(path: str, iteration: int) -> list[tuple[str, int, str]] | str:
    """The (file, size, checksum) entries of the record at ``path``, or what is wrong with it."""
    if not os.path.isfile(path):
        return f"{path} is missing (the save of iteration {iteration} did not finish)"
    try:
        with open(path, encoding="utf-8") as handle:
            record = json.load(handle)
        if record["format"] != _FORMAT or record["iteration"] != iteration:
            return f"{path} belongs to another format or iteration"
        files = record["files"].items()
        return sorted((str(name), int(v["size"]), str(v["sha256"])) for name, v in files)
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        return f"{path} is unreadable ({type(exc).__name__}: {exc})"


def verify_iteration(
    directory: str, iteration: int, *, shard: tuple[int, int] = (0, 1)
) -> Optional[str]:
    """Check ``iteration``'s files in ``directory`` against their record.

    Args:
        directory: the checkpoint directory (``--load``).
        iteration: the iteration to check.
        shard: (index, count): hash only the files whose position in the record is ``index``
            modulo ``count``; sizes and presence are checked for all files.

    Returns:
        None when intact, else one line naming the bad file and what is wrong with it.
    """
    root = iteration_dir(directory, iteration)
    if not os.path.isdir(root):
        return f"{root} does not exist"
    entries = _read_record(os.path.join(root, RECORD_NAME), iteration)
    if isinstance(entries, str):
        return entries
    for relative, size, _ in entries:
        path = os.path.join(root, relative)
        if not os.path.isfile(path):
            return f"{path} is missing"
        actual = os.path.getsize(path)
        if actual != size:
            return (
                f"{path} has {actual} bytes, its integrity record {size} (truncated or rewritten)"
            )
    index, count = shard
    for relative, _, checksum in entries[index::count]:
        path = os.path.join(root, relative)
        if _sha256(path) != checksum:
            return f"{path} does not match its checksum in {RECORD_NAME} (corrupted)"
    return None


def _iterations_on_disk(directory: str) -> list[int]:
    if not os.path.isdir(directory):
        return []
    found = []
    for name in os.listdir(directory):
        match = _ITERATION_DIR.match(name)
        if match and os.path.isdir(os.path.join(directory, name)):
            found.append(int(match.group(1)))
    return sorted(found)


def intact_iterations(directory: str) -> list[int]:
    """Iterations of ``directory`` whose files all match their record, oldest first."""
    return [i for i in _iterations_on_disk(directory) if verify_iteration(directory, i) is None]


def tracked_iteration(directory: str, flag: str = "--load") -> Optional[int]:
    """The iteration ``directory``'s tracker file names, or None when there is no tracker.

    Raises:
        CheckpointError: when the tracker holds anything but an iteration number.
    """
    tracker = os.path.join(directory, TRACKER_NAME)
    if not os.path.isfile(tracker):
        return None
    with open(tracker, encoding="utf-8", errors="replace") as handle:
        text = handle.read().strip()
    if not text.isdigit():
        raise CheckpointError(
            f"{flag} {directory}: {tracker} holds {text[:40]!r}, not an iteration number"
            + _way_forward(directory, None, flag)
        )
    return int(text)


def _way_forward(directory: str, bad: Optional[int], flag: str = "--load") -> str:
    """How to continue: the newest intact iteration (other than ``bad``) and how to load it."""
    candidates = [i for i in intact_iterations(directory) if i != bad]
    if not candidates:
        return (
            f"; {directory} holds no intact checkpoint: train from scratch without {flag} "
            f"(or with another {flag} directory)"
        )
    newest = candidates[-1]
    return (
        f"; the newest intact checkpoint is iteration {newest}: resume from it with "
        f"{flag} {directory} --ckpt-step {newest}"
    )


def iteration_to_load(
    directory: str,
    step: Optional[int] = None,
    *,
    shard: tuple[int, int] = (0, 1),
    flag: str = "--load",
) -> Optional[int]:
    """The iteration that ``--load directory`` (and ``--ckpt-step step``) would load, verified.

    ``flag`` names the directory's flag in messages (``--pretrained-checkpoint``).

    Returns:
        The iteration, or None when ``directory`` has no tracker and no ``step`` is asked for
        (nothing saved yet: training starts from scratch, as in Megatron).

    Raises:
        CheckpointError: naming the bad file, the newest intact iteration and how to load it.
    """
    iteration = step if step is not None else tracked_iteration(directory, flag)
    if iteration is None:
        return None
    problem = verify_iteration(directory, iteration, shard=shard)
    if problem is not None:
        source = f"--ckpt-step {step}" if step is not None else TRACKER_NAME
        root = iteration_dir(directory, iteration)
        unrecorded = os.path.isdir(root) and not os.path.isfile(os.path.join(root, RECORD_NAME))
        raise CheckpointError(
            f"{flag} {directory}: the checkpoint of iteration {iteration} ({source}) is not "
            f"intact: {problem}"
            + _way_forward(directory, iteration, flag)
            + (
                "; a checkpoint saved without a record (by an earlier version, or elsewhere) can "
                "be recorded once you trust it: python tools/record_checkpoint_integrity.py "
                f"{directory} --iteration {iteration}"
                if unrecorded
                else ""
            )
        )
    return iteration
