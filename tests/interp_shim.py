"""Import first in a TRITON_INTERPRET=1 process: Triton 3.6's interpreter does int() on a 1-element
array, which numpy >= 2.4 refuses. Test-only."""

import triton.runtime.interpreter as _interp

_orig = _interp._patch_lang_tensor


def _patched(tensor, scope):
    _orig(tensor, scope)
    scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))


_interp._patch_lang_tensor = _patched
