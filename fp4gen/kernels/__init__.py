"""CuTe DSL kernels written as ordinary Python classes, one per kind of kernel, configured by
frozen parameter objects whose fields are compile-time constants (``cutlass.const_expr``).

A generated module (``fp4gen.codegen``) binds the parameters of its spec and compiles the class;
the kernel's code is read here, once, for every format. Imported only where a kernel is compiled
(it loads cutlass)."""
