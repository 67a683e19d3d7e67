"""Bitwise replay harness: run a kernel forward and backward repeatedly, demand identical bits.

Tolerance-based tests cannot see a kernel that rounds differently on every run (float atomics,
split-K reductions, autotuned tilings): each run is "close" to the reference, yet training is not
reproducible and the exactness tests of shared-prefix training turn flaky. Replaying the same
inputs and comparing bit patterns catches exactly that. Every entry of kernels/manifest.py is
covered by a test built on `assert_bitwise_replay`; docs/determinism.md shows how to write one.

cuBLAS reproduces matrix products under deterministic settings only when CUBLAS_WORKSPACE_CONFIG
is set before its first use in the process; importing this module sets ":4096:8" unless the
environment already has a value.
"""

import contextlib
import os

import torch

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

# Integer dtypes of each width, to compare floating-point tensors by their bit patterns:
# torch.equal calls -0.0 and 0.0 equal and a NaN unequal to itself; neither is "bitwise".
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@contextlib.contextmanager
def deterministic_settings(warn_only=False):
    """Switch on PyTorch's deterministic algorithms (and cuDNN's) and restore the previous settings.

    With warn_only=False an op that has no deterministic implementation raises instead of silently
    running a nondeterministic one; pass warn_only=True only for an op known to lack one, and say
    so in the manifest entry's notes.
    """
    saved = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
        torch.backends.cudnn.deterministic,
        torch.backends.cudnn.benchmark,
    )
    torch.use_deterministic_algorithms(True, warn_only=warn_only)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(saved[0], warn_only=saved[1])
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = saved[2], saved[3]


def assert_bitwise_replay(
    fn,
    make_inputs,
    *,
    runs=2,
    concurrent_stream_work=False,
    module=None,
    seed=0,
    warn_only=False,
):
    """Run fn forward and backward `runs` times from identical inputs; fail unless all bits agree.

    fn(*inputs) returns a tensor or a (possibly nested) tuple/list of tensors. make_inputs()
    returns the positional arguments (a tuple, or one object); it is called afresh for every run,
    right after torch.manual_seed(seed), so random inputs are identical and no state leaks between
    runs. The floating outputs are reduced to a scalar with fixed random weights (a plain sum could
    hide errors that cancel), which is backpropagated to every argument tensor that requires grad
    and to every parameter of `module` that does. Outputs, gradients and the inputs themselves are
    compared with run 0 bit for bit; the AssertionError names each tensor that differed and in how
    many elements.

    On CUDA, concurrent_stream_work=True runs at least 3 times while a second stream multiplies
    unrelated matrices, a different amount each run: kernels whose results depend on how blocks
    are scheduled or on how many SMs are free then show it. On CPU the flag changes nothing.

    Returns run 0's tensors by name ("output[0]", "grad of input[1]", "grad of param weight", ...).
    """
    if runs < 2:
        raise ValueError(f"a replay needs at least 2 runs, got {runs}")
    cuda_devices = list(range(torch.cuda.device_count())) if torch.cuda.is_available() else []
    reference = None
    failures = []
    with torch.random.fork_rng(devices=cuda_devices), deterministic_settings(warn_only):
        run_index = 0
        # A while loop: the device, and so whether runs grows to 3, is known only from the inputs.
        while run_index < runs:
            torch.manual_seed(seed)
            args = make_inputs()
            args = args if isinstance(args, tuple) else (args,)
            tensors = [a for a in args if isinstance(a, torch.Tensor)]
            device = next((t.device for t in tensors if t.is_cuda), None)
            if concurrent_stream_work and device is not None:
                runs = max(runs, 3)
                with _busy_side_stream(device, run_index):
                    record = _run_once(fn, args, module, seed)
            else:
                record = _run_once(fn, args, module, seed)
            if reference is None:
                reference = record
            else:
                failures.extend(_differences(reference, record, run_index))
            run_index += 1
    if failures:
        raise AssertionError("bitwise replay failed:\n  " + "\n  ".join(failures))
    return reference


def _run_once(fn, args, module, seed):
    """One forward and backward; returns copies of inputs, outputs and gradients by name."""
    inputs = {i: a for i, a in enumerate(args) if isinstance(a, torch.Tensor)}
    record = {f"input[{i}]": a.detach().clone() for i, a in inputs.items()}
    outputs = _flatten(fn(*args))
    for i, out in enumerate(outputs):
        record[f"output[{i}]"] = out.detach().clone()

    targets = {f"grad of input[{i}]": a for i, a in inputs.items() if a.requires_grad}
    if module is not None:
        targets.update(
            (f"grad of param {name}", p) for name, p in module.named_parameters() if p.requires_grad
        )
    if not targets:
        return record
    # A fresh generator per run gives every run the same weights and leaves torch's RNG alone.
    weights = torch.Generator().manual_seed(seed + 1)
    loss = None
    for out in outputs:
        if out.requires_grad:
            w = torch.randn(out.shape, generator=weights).to(out.device, out.dtype)
            term = (out * w).sum().float()
            loss = term if loss is None else loss + term
    if loss is None:
        raise ValueError(f"no output of fn requires grad, so nothing reaches {', '.join(targets)}")
    grads = torch.autograd.grad(loss, list(targets.values()), allow_unused=True)
    for name, grad in zip(targets, grads):
        record[name] = None if grad is None else grad.detach().clone()
    return record


def _flatten(value):
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _flatten(v)]
    raise TypeError(f"fn must return tensors or tuples/lists of them, not {type(value).__name__}")


def _bits(t):
    if t.is_complex():
        t = torch.view_as_real(t)
    if t.is_floating_point():
        t = t.contiguous().view(_BITS[t.element_size()])
    return t


def _differences(reference, record, run_index):
    """Messages for every tensor of this run whose bits differ from run 0's."""
    messages = []
    for name in reference.keys() | record.keys():
        ref, got = reference.get(name), record.get(name)
        where = f"run {run_index} vs run 0, {name}"
        if ref is None or got is None:
            if ref is not got:
                messages.append(f"{where}: present in one run only (None or missing in the other)")
            continue
        if ref.shape != got.shape or ref.dtype != got.dtype or ref.device != got.device:
            messages.append(
                f"{where}: {tuple(ref.shape)} {ref.dtype} on {ref.device} vs "
                f"{tuple(got.shape)} {got.dtype} on {got.device}"
            )
            continue
        mismatch = _bits(ref) != _bits(got)
        if ref.is_complex():
            mismatch = mismatch.any(-1)
        count = int(mismatch.sum())
        if count:
            first = tuple(int(i) for i in torch.nonzero(mismatch)[0]) if ref.dim() else ()
            detail = f"first at index {first}"
            if ref.is_floating_point():
                gap = (got.double() - ref.double()).abs().nan_to_num(nan=float("inf"))
                detail += f", max |difference| {float(gap.max()):.3g}"
            messages.append(f"{where}: {count} of {ref.numel()} elements differ bitwise ({detail})")
        if name.startswith("input[") and count:
            messages.append(f"{where}: make_inputs is not deterministic; the replay proves nothing")
    return sorted(messages)


@contextlib.contextmanager
def _busy_side_stream(device, run_index):
    """Keep a second CUDA stream multiplying unrelated matrices while the body runs."""
    current = torch.cuda.current_stream(device)
    side = torch.cuda.Stream(device)
    a = torch.randn(2048, 2048, device=device)
    product = torch.empty_like(a)
    side.wait_stream(current)
    with torch.cuda.stream(side):
        # A different amount of competing work per run, so each replay overlaps differently.
        for _ in range(4 + 8 * run_index):
            torch.mm(a, a, out=product)
    try:
        yield
    finally:
        # `a` and `product` stay referenced (this frame) until the side stream is done with them.
        torch.cuda.synchronize(device)
