"""The child side of the kill-during-save test: train, and SIGKILL this process at a chosen point
of a checkpoint save.

Children are forked from a forkserver (test_training_checkpoint_integrity.py) that imported this
module and the trainer once: forking the test process itself is not safe once autograd's worker
threads exist there.
"""

import io
import os
import signal
import traceback

import torch

from megatron.shared_prefix.training import checkpointing, loop

# Points of a save: the iteration directory created and nothing written (start), a prefix of the
# checkpoint file written (mid-file), and before / after the N-th rename of the save: 1 the
# checkpoint file, 2 the integrity record, 3 the tracker. after-rename-1 is between the files and
# before the record.
KILL_POINTS = (
    "start",
    "mid-file",
    "before-rename-1",
    "after-rename-1",
    "before-rename-2",
    "after-rename-2",
    "before-rename-3",
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
    fraction of the checkpoint file written at ``mid-file``). Exits 3 if no kill happened."""
    try:
        _install(point, iteration, cut)
        loop.run(argv, log=lambda line: None)
    except BaseException:  # pylint: disable=broad-exception-caught
        traceback.print_exc()
    finally:
        os._exit(3)  # pylint: disable=protected-access


def _die():
    os.kill(os.getpid(), signal.SIGKILL)


def _install(point, iteration, cut):
    save, replace, torch_save = checkpointing.save_checkpoint, os.replace, torch.save
    state = {"saving": False, "renames": 0}

    def counting_replace(source, target):
        if state["saving"]:
            state["renames"] += 1
            if point == f"before-rename-{state['renames']}":
                _die()
        replace(source, target)
        if state["saving"] and point == f"after-rename-{state['renames']}":
            _die()

    def partial_torch_save(obj, handle):
        if state["saving"] and point == "start":
            _die()
        if state["saving"] and point == "mid-file":
            buffer = io.BytesIO()
            torch_save(obj, buffer)
            handle.write(buffer.getvalue()[: int(cut * buffer.tell())])
            handle.flush()
            _die()
        return torch_save(obj, handle)

    def watched_save(directory, position, **kwargs):
        state["saving"] = position.iteration == iteration
        return save(directory, position, **kwargs)

    os.replace = counting_replace
    torch.save = partial_torch_save
    loop.save_checkpoint = watched_save
