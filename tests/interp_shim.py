"""Import first in a TRITON_INTERPRET=1 process. Test-only patches of Triton 3.6's interpreter:

  * numpy >= 2.4: the interpreter does int() on a 1-element array, which numpy refuses;
  * speed: every call of a @triton.jit helper from a kernel (tl.sum, tl.cdiv, the kernels' own helpers)
    re-patched triton.language: an inspect.getmembers walk of tl, tl.tensor, tl.math and tl.core, about
    a quarter of an interpreted run. A walk over a module already patched changes nothing (its builtins
    are already the interpreter's wrappers, which are not builtins), so a helper whose language modules
    are all patched now is called without it: the launch's own (undone when the launch ends) and those a
    helper's call patched before (never undone, by the interpreter itself). The same functions run;
  * speed: the interpreter's tl dtype -> numpy dtype map (_get_np_dtype) was a dict of 19 np.dtype
    built on every call (hundreds of thousands a run): the same map, built once;
  * row invariance: tl.dot was one np.matmul of the block, and BLAS computes a row of a GEMM by the code
    its position calls for (an M-tail of the micro-kernel sums in another order: on an AMD EPYC with
    numpy 2.4's OpenBLAS 0.3.31, wide.linear's row t differed by ~5e-7 with its slice's start), which the
    GPU's kernel never does; now each row of the block is its own [1, K] @ [K, N] product, a function of
    that row alone, whatever the BLAS and the CPU, and of the operands' values alone (b made contiguous:
    a transposed view summed in another order, where the GPU's MMA does not care how a tile was loaded).
    An fp8 x fp8 dot (the interpreter: both to fp16, then numpy's matmul into fp32, whose loop order follows the
    CPU's SIMD and the operands' layout: on that EPYC gemv's two orientations differed) is summed exactly in
    float64, then rounded once: each product has at most 8 significant bits, between 2^-18 and 2^17.6 (e4m3's
    least subnormal and 448 squared), so a sum of up to 2^16 of them is exact in 53 bits, in any order.
Importing it twice (as interp_shim and as tests.interp_shim) patches once."""

import inspect

import triton.language as tl
import triton.runtime.interpreter as _interp

if not getattr(_interp, "_baton_shim", False):
    _interp._baton_shim = True
    _orig_tensor = _interp._patch_lang_tensor
    _patch_lang = _interp._patch_lang
    _active: list[frozenset[int]] = []  # per launch in progress: its language modules (ids), patched until it ends
    _kept: set[int] = set()  # modules a helper's call patched outside its launch's own: patched for good

    def _patched_tensor(tensor, scope):
        _orig_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    _langs_of: dict = {}

    def _langs(fn) -> frozenset[int]:
        if fn not in _langs_of:  # a module's imports are made once, at its import
            _langs_of[fn] = frozenset(
                id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core)
            )
        return _langs_of[fn]

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

    _orig_np_dtype = _interp._get_np_dtype
    _NP = {t: _orig_np_dtype(t) for t in (tl.int1, tl.float16, tl.float32, tl.float64, tl.bfloat16)}
    _NP |= {t: _orig_np_dtype(t) for t in (tl.int8, tl.uint8, tl.int16, tl.uint16, tl.int32, tl.uint32)}
    _NP |= {t: _orig_np_dtype(t) for t in (tl.int64, tl.uint64, tl.float8e5, tl.float8e5b16, tl.float8e4nv)}
    _NP |= {t: _orig_np_dtype(t) for t in (tl.float8e4b8, tl.float8e4b15)}
    _U64 = _interp.np.dtype(_interp.np.uint64)

    def _get_np_dtype(tt_dtype):  # _interp._get_np_dtype's branches, over the map built once
        if isinstance(tt_dtype, tl.pointer_type):
            return _U64
        if isinstance(tt_dtype, tl.block_type):
            if isinstance(tt_dtype.element_ty, tl.pointer_type):
                return _U64
            return _NP[tt_dtype.element_ty]
        return _NP[tt_dtype]

    _orig_dot = _interp.InterpreterBuilder.create_dot

    def _fp8(t) -> bool:
        return t.dtype.primitive_bitwidth == 8 and t.dtype.is_floating()

    def _exact(t):  # an fp8 operand's values in float64 (through fp16, as the interpreter converts them)
        return _interp._convert_float(t.data, t.dtype, tl.float16, None).view(_interp.np.float16).astype("float64")

    def _create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if _fp8(a) and _fp8(b) and a.data.ndim == 2:  # exact: see the module doc
            exact = _interp.np.matmul(_exact(a), _exact(b))
            return _interp.TensorHandle(exact.astype(d.data.dtype) + d.data, d.dtype.scalar)
        if _fp8(a) or _fp8(b) or a.data.ndim != 2:  # converted to fp16 inside, or a batched dot: as the interpreter
            return _orig_dot(self, a, b, d, input_precision, max_num_imprecise_acc)
        acc = d.data
        bd = _interp.np.ascontiguousarray(b.data)  # a transposed view (tl.dot(a, b.T)) takes another BLAS path
        rows = [_interp.np.matmul(a.data[i : i + 1], bd, dtype=acc.dtype) for i in range(a.data.shape[0])]
        return _interp.TensorHandle(_interp.np.concatenate(rows) + acc, d.dtype.scalar)

    _interp.InterpreterBuilder.create_dot = _create_dot
    _interp._get_np_dtype = _get_np_dtype
    _interp._patch_lang_tensor = _patched_tensor
    _interp._patch_lang = _launch_patch  # looked up as a module global by GridExecutor.__call__
    _interp.InterpretedFunction.__call__ = _call
