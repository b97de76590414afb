"""CuTe DSL device code that generated modules import instead of carrying it as template text.

* ``dequant``: the dequantize kernel as one class for every format, configured by a frozen
  parameter object whose fields are compile-time constants (``cutlass.const_expr``);
* ``gemm_sm90``: the Hopper wgmma fused GEMM as one class (``GemmSm90Kernel``, with a bias
  ``GemmSm90BiasKernel``), configured likewise by ``GemmSm90Params`` and given its e2m1 decode;
* ``gemm_sm90_small``: the Hopper small-M fused GEMM (mma.sync on operands decoded in
  registers, split-K) as one class (``GemmSm90SmallKernel``, with a bias
  ``GemmSm90SmallBiasKernel``), configured by ``GemmSm90SmallParams`` and given its decodes;
* ``gemm_sm90_base``: what the two Hopper GEMM classes share (``GemmSm90Base``: the TMA and
  cp.async producer warp, the stage barriers, the epilogue's arithmetic; ``GemmSm90BaseParams``);
* ``sm90_decode``: the Hopper GEMMs' e2m1 decodes and scale conversions;
* ``sm90_ptx``: the PTX inline-asm wrappers both Hopper GEMMs and the decodes use (shared and
  global loads and stores, cp.async, atomics, mma.sync, prmt, the bf16x2 multiply);
* ``quantize``: the rowwise quantize kernels (``RowwiseAmaxKernel``, ``RowwiseQuantizeKernel``)
  configured by ``RowwiseParams``; the generated module's subclasses spell only the entry (the
  compiled function's and the kernel's arguments);
* the quantize kernels' device helpers, each written once: ``encode`` (element codes for every
  format and rounding, the packed bit stream), ``scale`` (global and block scales), ``philox``
  (the random bits of stochastic rounding), ``quant_ptx`` (their PTX inline-asm wrappers).

A generated module (``fp4gen.codegen``) binds what its spec needs and compiles it. Imported only
where a kernel is compiled (it loads cutlass)."""
