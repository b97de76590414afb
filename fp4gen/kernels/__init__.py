"""CuTe DSL device code that generated modules import instead of carrying it as template text.

* ``dequant``: the dequantize kernel as one class for every format, configured by a frozen
  parameter object whose fields are compile-time constants (``cutlass.const_expr``);
* ``gemm_sm90``: the Hopper wgmma fused GEMM as one class (``GemmSm90Kernel``, with a bias
  ``GemmSm90BiasKernel``), configured likewise by ``GemmSm90Params`` and given its e2m1 decode;
* ``gemm_sm90_small``: the Hopper small-M fused GEMM (mma.sync on operands decoded in
  registers, split-K) as one class (``GemmSm90SmallKernel``, with a bias
  ``GemmSm90SmallBiasKernel``), configured by ``GemmSm90SmallParams`` and given its decodes;
* ``sm90_decode``: the Hopper GEMMs' e2m1 decodes and PTX helpers.

A generated module (``fp4gen.codegen``) binds what its spec needs and compiles it. Imported only
where a kernel is compiled (it loads cutlass)."""
