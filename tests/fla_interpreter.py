"""fla-core's Triton kernels under Triton's interpreter (TRITON_INTERPRET=1, CPU tensors), so the
CPU suite checks the calls kernels/triton/kda.py makes into fla against the torch reference.

Three gaps between a compiled kernel and the interpreter, closed here for the test process only:
- fla's autotuners time their configs through the GPU driver, which the interpreter lacks: every
  config ties and the first one runs (configs change speed, not results).
- fla bounds loops by program-id arithmetic, 1-element arrays in the interpreter, which numpy 2
  refuses to turn into an int.
- fla calls `.to(tl.int64)` on a Python `range` loop index, a tensor once compiled and a plain int
  in the interpreter: fla's modules get a `range` whose indices answer `.to`.

fla-core is installed beside the venv (`make test`: .venv/fla-interp, on PYTHONPATH for the
interpreter pass only): where fla is importable, transformers' glm5_next takes fla's kernels
over its torch path, which would move the oracle of the main pass off torch.
"""

from __future__ import annotations

import builtins
import sys

import numpy as np


class _LoopIndex(int):
    """A `range` index that also answers .to(dtype), as a compiled kernel's loop index does."""

    def to(self, dtype, **_):
        import triton.language as tl
        from triton.runtime.interpreter import TensorHandle

        np_dtype = {tl.int32: np.int32, tl.int64: np.int64}[dtype]
        return tl.tensor(TensorHandle(np.array(int(self), dtype=np_dtype), dtype), dtype)


def _kernel_range(*args):
    for i in builtins.range(*args):
        yield _LoopIndex(i)


def install() -> bool:
    """Patches the interpreter and fla's kernel modules; False where fla is not importable."""
    try:
        import fla.ops.kda  # noqa: F401  (imports the kernel modules patched below)
    except ImportError:
        return False
    import triton.runtime.autotuner as autotuner
    import triton.runtime.interpreter as interpreter

    autotuner.Autotuner.do_bench = property(lambda self: lambda fn, quantiles=None, **_: [1.0] * 3)
    patch_tensor = interpreter._patch_lang_tensor

    def patch_tensor_index(tensor, scope):
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda t: int(np.asarray(t.handle.data).reshape(-1)[0]))

    interpreter._patch_lang_tensor = patch_tensor_index
    for name, module in list(sys.modules.items()):
        if name.startswith("fla.ops.") and module is not None:
            module.range = _kernel_range
    return True
