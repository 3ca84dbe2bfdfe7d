"""Triton's CPU interpreter (TRITON_INTERPRET=1), patched where Triton 3.6's has gaps: the CPU
cases of tests/test_triton_kernels_*.py run the real kernels through it."""

from __future__ import annotations

import collections


def patch_triton_interpreter() -> None:
    """Work around Triton 3.6 interpreter gaps (interpreter only; compiled kernels untouched):
    runtime loop bounds (numpy >= 2.4 refuses int() of a 1-element array), tensor-valued loop
    variables (fla calls .to() on them), bf16 tl.dot (the interpreter multiplies the raw
    uint16 bits), fp32 -> bf16 casts (it truncates; compiled kernels round to nearest even), and
    autotuning (it benchmarks through a GPU driver). Also checks every access's bounds
    (_check_bounds): the interpreter reads and writes host memory wherever a pointer points."""
    import numpy as np
    import triton.language as tl
    import triton.runtime.autotuner as autotuner
    import triton.runtime.interpreter as interp

    if getattr(interp, "_pdserve_patched", False):
        return
    interp._pdserve_patched = True

    def tensor_range(a1, a2=None, step=None, **_):
        start, end = (0, a1) if a2 is None else (a1, a2)
        for i in range(int(start), int(end), int(1 if step is None else step)):
            yield tl.core.tensor(
                interp.TensorHandle(np.array([i], dtype=np.int32), tl.int32), tl.int32
            )

    orig_tensor = interp._patch_lang_tensor

    def patch_tensor(tensor, scope):
        orig_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interp._patch_lang_tensor = patch_tensor

    orig_core = interp._patch_lang_core

    def patch_core(lang, scope):
        orig_core(lang, scope)
        scope.set_attr(lang, "range", tensor_range)

    interp._patch_lang_core = patch_core

    orig_lang = interp._patch_lang

    def patch_lang(fn):
        import sys

        scope = orig_lang(fn)
        module = sys.modules.get(fn.__module__)
        if module is not None:  # builtin range() inside kernels: tensor induction variables
            scope.set_attr(module, "range", tensor_range)
        return scope

    interp._patch_lang = patch_lang

    orig_dot = interp.InterpreterBuilder.create_dot

    def as_f32(h):
        if h.dtype.scalar == tl.bfloat16:
            return interp.TensorHandle(
                (h.data.astype(np.uint32) << 16).view(np.float32), tl.float32
            )
        return h

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        return orig_dot(self, as_f32(a), as_f32(b), d, input_precision, max_num_imprecise_acc)

    interp.InterpreterBuilder.create_dot = create_dot

    orig_cast = interp.InterpreterBuilder.cast_impl

    def cast_impl(self, src, dst_type):
        # fp32 -> bf16: round to nearest even, as compiled Triton's .to(tl.bfloat16) does (the
        # interpreter truncates, which drifts a kernel's bf16 roundings from torch's)
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            bits = np.ascontiguousarray(src.data, dtype=np.float32).view(np.uint32)
            bits = bits.astype(np.uint64)
            rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
            nan = np.isnan(src.data)
            out = np.where(nan, (bits >> 16) | 0x40, rounded).astype(np.uint16)
            return interp.TensorHandle(out, tl.bfloat16)
        return orig_cast(self, src, dst_type)

    interp.InterpreterBuilder.cast_impl = cast_impl
    _check_bounds(interp, np)
    autotuner.Autotuner.prune_configs = lambda self, kwargs, *a: self.configs[:1]
    autotuner.Autotuner._bench = lambda self, *a, config=None, **k: [1.0, 1.0, 1.0]


# Kernels that address memory through a table of pointers held in a tensor (not their arguments'
# storages): their accesses are not bounds-checked.
ADDRESS_TABLE_KERNELS = {"_kda_roll_back_kernel"}


def _check_bounds(interp, np) -> None:
    """Every interpreted load, store and atomic must touch only the storages of the launch's
    tensor arguments, else the launch raises IndexError naming the kernel, the access and the
    nearest argument. Compiled on a GPU such an access is an illegal address (or silently reads
    a neighbour's bytes); the interpreter, reading host memory, would pass it unnoticed. Masked-
    off lanes are not accesses."""
    # the running launch (one at a time): its kernel, its storages' argument names, starts and
    # ends; None while an exempt kernel runs
    running: list[tuple[str, list[str], np.ndarray, np.ndarray] | None] = [None]
    init_args = interp.GridExecutor._init_args_hst

    def spans(name, arg):
        if isinstance(arg, tuple):
            for i, a in enumerate(arg):
                yield from spans(f"{name}[{i}]", a)
        elif hasattr(arg, "base") and hasattr(arg, "block_shape"):  # a TensorDescriptor
            yield from spans(name, arg.base)
        elif hasattr(arg, "untyped_storage"):
            storage = arg.untyped_storage()
            if storage.nbytes():
                yield storage.data_ptr(), storage.data_ptr() + storage.nbytes(), name

    def init_args_hst(self, args_dev, kwargs):
        args_hst, kwargs_hst = init_args(self, args_dev, kwargs)
        running[0] = None
        if self.fn.__name__ in ADDRESS_TABLE_KERNELS:
            return args_hst, kwargs_hst
        named = [*zip(self.arg_names, args_hst), *kwargs_hst.items()]
        found = sorted({s for name, a in named for s in spans(name, a)})
        starts = np.array([s[0] for s in found], dtype=np.uint64)
        ends = np.array([s[1] for s in found], dtype=np.uint64)
        running[0] = (self.fn.__name__, [s[2] for s in found], starts, ends)
        return args_hst, kwargs_hst

    def check(access, ptrs, mask, itemsize):
        if running[0] is None:
            return
        kernel, names, starts, ends = running[0]
        addr = np.asarray(ptrs.data).astype(np.uint64)
        if mask is not None:
            addr = addr[np.broadcast_to(np.asarray(mask.data, dtype=bool), addr.shape)]
        if addr.size == 0:
            return
        i = np.searchsorted(starts, addr, side="right").astype(np.int64) - 1
        inside = (i >= 0) & (addr + np.uint64(itemsize) <= ends[np.maximum(i, 0)])
        if inside.all():
            return
        bad = int(addr[~inside][0])
        near = int(np.argmin(np.abs(starts.astype(np.float64) - bad))) if len(starts) else None
        where = (
            f"{bad - int(starts[near]):+d} bytes from the start of {names[near]}'s storage "
            f"({int(ends[near] - starts[near])} bytes)"
            if near is not None
            else "no tensor argument"
        )
        raise IndexError(
            f"{kernel}: {access} of {int((~inside).sum())} of {addr.size} elements outside "
            f"every tensor argument's storage; the first {where}"
        )

    builder = interp.InterpreterBuilder
    load, store = builder.create_masked_load, builder.create_masked_store
    rmw, cas = builder.create_atomic_rmw, builder.create_atomic_cas

    def create_masked_load(self, ptrs, mask, other, *args, **kwargs):
        check("load", ptrs, mask, interp._get_np_dtype(ptrs.get_element_ty()).itemsize)
        return load(self, ptrs, mask, other, *args, **kwargs)

    def create_masked_store(self, ptrs, value, mask, *args, **kwargs):
        check("store", ptrs, mask, value.data.dtype.itemsize)
        return store(self, ptrs, value, mask, *args, **kwargs)

    def create_atomic_rmw(self, op, ptr, val, mask, *args, **kwargs):
        check("atomic", ptr, mask, val.data.dtype.itemsize)
        return rmw(self, op, ptr, val, mask, *args, **kwargs)

    def create_atomic_cas(self, ptr, cmp, val, *args, **kwargs):
        check("atomic", ptr, None, val.data.dtype.itemsize)
        return cas(self, ptr, cmp, val, *args, **kwargs)

    interp.GridExecutor._init_args_hst = init_args_hst
    builder.create_masked_load = create_masked_load
    builder.create_masked_store = create_masked_store
    builder.create_atomic_rmw = create_atomic_rmw
    builder.create_atomic_cas = create_atomic_cas


def count_launches(monkeypatch) -> collections.Counter:
    """Interpreted kernel launches by kernel name from here on (monkeypatch undoes the hook);
    the Counter fills as kernels launch."""
    import triton.runtime.interpreter as interpreter

    launches: collections.Counter = collections.Counter()
    launch = interpreter.GridExecutor.__call__

    def counted(self, *args, **kwargs):
        launches[self.fn.__name__] += 1
        return launch(self, *args, **kwargs)

    monkeypatch.setattr(interpreter.GridExecutor, "__call__", counted)
    return launches
