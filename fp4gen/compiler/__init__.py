"""Recipe -> kernel plan -> generated CuTe DSL source -> compiled kernels."""
