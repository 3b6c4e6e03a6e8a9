"""Portable Triton kernels shared by the NVIDIA and AMD backends (imported only by backends/).

Importing the package fixes the CPU interpreter's loop bounds for every kernel module in it (each imports the package
first), not only for those that happen to import one module that did (`kernels.triton.moe_blocks` alone failed
under TRITON_INTERPRET=1 when its tests ran by themselves).
"""
import os


def _let_interpreter_index_size_one_arrays() -> None:
    """Triton 3.6's interpreter holds every scalar as a 1-element numpy array and converts loop bounds with
    int(array), which numpy >= 2.4 refuses for arrays with ndim > 0; so `range(0, n)` with a runtime n fails under
    TRITON_INTERPRET=1. Convert through .item() instead (a no-op outside the interpreter)."""
    if os.environ.get("TRITON_INTERPRET", "0") != "1":
        return
    from triton.runtime import interpreter
    original = interpreter._patch_lang_tensor
    if getattr(original, "_k3core_index_fix", False):
        return

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patched._k3core_index_fix = True
    interpreter._patch_lang_tensor = patched


_let_interpreter_index_size_one_arrays()
