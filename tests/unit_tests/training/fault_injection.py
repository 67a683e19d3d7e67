"""The child side of the kill-during-save test: train, and SIGKILL this process at a chosen point
of a checkpoint save.

Children are forked from a forkserver (test_training_checkpoint_integrity.py) that imported this
module and the trainer once: forking the test process itself is not safe once autograd's worker
threads exist there.
"""

import multiprocessing
import os
import signal
import traceback

import torch

from megatron.shared_prefix.training import checkpointing, loop

# Points of a save: the iteration directory created and nothing written (start), the files of
# megatron's distributed save written with one of them cut short (mid-file) or whole
# (after-files), and before / after the N-th rename after them: 1 the integrity record, 2 the
# tracker.
KILL_POINTS = (
    "start",
    "mid-file",
    "after-files",
    "before-rename-1",
    "after-rename-1",
    "before-rename-2",
)


def _import_what_the_loop_imports_on_first_use():
    """Imported once in the forkserver, so that no forked child spends seconds importing them."""
    # pylint: disable=unused-import
    import megatron.core.optimizer_param_scheduler  # noqa: F401
    import megatron.training.arguments  # noqa: F401

    import megatron.shared_prefix.models.hybrid.hybrid_model  # noqa: F401


_import_what_the_loop_imports_on_first_use()


def train_and_kill(argv, point, iteration, cut):
    """Run the loop on ``argv``; SIGKILL at ``point`` of the save of ``iteration`` (``cut``: the
    fraction of the largest checkpoint file kept at ``mid-file``). Exits 3 if no kill happened."""
    try:
        _install(point, iteration, cut)
        loop.run(argv, log=lambda line: None)
    except BaseException:  # pylint: disable=broad-exception-caught
        traceback.print_exc()
    finally:
        os._exit(3)  # pylint: disable=protected-access


def _die():
    # The whole job dies, as when a launcher kills its process group: megatron's distributed
    # save runs a multiprocessing manager process, which would outlive a SIGKILL of this one.
    for child in multiprocessing.active_children():
        child.kill()
    os.kill(os.getpid(), signal.SIGKILL)


def _largest_file(root):
    sizes = {}
    for folder, _, names in os.walk(root):
        for name in names:
            sizes[os.path.join(folder, name)] = os.path.getsize(os.path.join(folder, name))
    return max(sizes, key=sizes.get)


def _install(point, iteration, cut):
    from megatron.core import dist_checkpointing

    save, replace, distributed_save = (
        checkpointing.save_checkpoint,
        os.replace,
        dist_checkpointing.save,
    )
    state = {"saving": False, "files_written": False, "renames": 0}

    def counting_replace(source, target):
        if state["files_written"]:
            state["renames"] += 1
            if point == f"before-rename-{state['renames']}":
                _die()
        replace(source, target)
        if state["files_written"] and point == f"after-rename-{state['renames']}":
            _die()

    def watched_distributed_save(sharded_state_dict, directory, *args, **kwargs):
        if state["saving"] and point == "start":
            _die()
        result = distributed_save(sharded_state_dict, directory, *args, **kwargs)
        if state["saving"]:
            if point == "mid-file":
                path = _largest_file(directory)
                os.truncate(path, int(cut * os.path.getsize(path)))
                _die()
            if point == "after-files":
                _die()
            state["files_written"] = True
        return result

    def watched_save(directory, position, **kwargs):
        state["saving"] = position.iteration == iteration
        state["files_written"] = False
        return save(directory, position, **kwargs)

    os.replace = counting_replace
    dist_checkpointing.save = watched_distributed_save
    loop.save_checkpoint = watched_save
