"""Import first in a TRITON_INTERPRET=1 process. Test-only patches of Triton 3.6's interpreter:

  * numpy >= 2.4: the interpreter does int() on a 1-element array, which numpy refuses;
  * speed: every call of a @triton.jit helper from a kernel (tl.sum, tl.cdiv, the kernels' own helpers)
    re-patched triton.language: an inspect.getmembers walk of tl, tl.tensor, tl.math and tl.core, about
    a quarter of an interpreted run. A walk over a module already patched changes nothing (its builtins
    are already the interpreter's wrappers, which are not builtins), so a helper whose language modules
    are all patched now is called without it: the launch's own (undone when the launch ends) and those a
    helper's call patched before (never undone, by the interpreter itself). The same functions run.
Importing it twice (as interp_shim and as tests.interp_shim) patches once."""

import inspect

import triton.language as tl
import triton.runtime.interpreter as _interp

if not getattr(_interp, "_baton_shim", False):
    _interp._baton_shim = True
    _orig_tensor = _interp._patch_lang_tensor
    _patch_lang = _interp._patch_lang
    _active: list[set[int]] = []  # per launch in progress: its language modules (ids), patched until it ends
    _kept: set[int] = set()  # modules a helper's call patched outside its launch's own: patched for good

    def _patched_tensor(tensor, scope):
        _orig_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    def _langs(fn) -> set[int]:
        return {id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core)}

    def _launch_patch(fn):  # GridExecutor.__call__'s: the launch's patches, undone by scope.restore()
        scope = _patch_lang(fn)
        _active.append(_langs(fn))
        restore = scope.restore

        def _restore():
            _active.pop()
            restore()

        scope.restore = _restore
        return scope

    def _call(self, *args, **kwargs):  # InterpretedFunction.__call__: a device function call
        langs = _langs(self.fn)
        if not _active or not langs <= _active[-1] | _kept:
            _patch_lang(self.fn)  # as the interpreter does (its scope is never restored)
            if _active:
                _kept.update(langs - _active[-1])
        fn = self.rewrite()
        try:
            return fn(*args, **kwargs)
        except Exception as e:
            raise _interp.InterpreterError(repr(e)) from e

    _interp._patch_lang_tensor = _patched_tensor
    _interp._patch_lang = _launch_patch  # looked up as a module global by GridExecutor.__call__
    _interp.InterpretedFunction.__call__ = _call
