"""Triton's CPU interpreter (TRITON_INTERPRET=1), patched where Triton 3.6's has gaps: the CPU
cases of tests/test_triton_kernels_*.py run the real kernels through it."""

from __future__ import annotations

import collections


def patch_triton_interpreter() -> None:
    """Work around Triton 3.6 interpreter gaps (interpreter only; compiled kernels untouched):
    runtime loop bounds (numpy >= 2.4 refuses int() of a 1-element array), tensor-valued loop
    variables (fla calls .to() on them), bf16 tl.dot (the interpreter multiplies the raw
    uint16 bits), fp32 -> bf16 casts (it truncates; compiled kernels round to nearest even), and
    autotuning (it benchmarks through a GPU driver)."""
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
    autotuner.Autotuner.prune_configs = lambda self, kwargs, *a: self.configs[:1]
    autotuner.Autotuner._bench = lambda self, *a, config=None, **k: [1.0, 1.0, 1.0]


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
