"""Pure-torch reference numerics (CPU and CUDA): the bit-exact oracle for generated kernels."""

from fp4gen.numerics.block_scaled import (
    block_scaled_error_bound,
    gemm_block_scaled_reference,
    k_segments,
)
from fp4gen.numerics.gemm import gemm_reference
from fp4gen.numerics.hadamard import (
    hadamard_matrix,
    inverse_rht,
    rht,
    rht_matrix,
    rht_scale,
    rht_signs,
)
from fp4gen.numerics.layout import (
    pack,
    packed_cols,
    swizzle_scales,
    swizzled_size,
    unpack,
    unswizzle_scales,
)
from fp4gen.numerics.metrics import ErrorStats, error_stats
from fp4gen.numerics.minifloat import (
    code_value,
    decode,
    encode,
    encode_scale,
    grid_values,
    max_exponent,
    max_finite,
    nan_code,
)
from fp4gen.numerics.philox import philox4x32, random_bits, random_words
from fp4gen.numerics.quantize import (
    QuantizedTensor,
    quantize,
    resolve_format,
    resolve_rht,
)

__all__ = [
    "ErrorStats",
    "QuantizedTensor",
    "block_scaled_error_bound",
    "code_value",
    "decode",
    "encode",
    "encode_scale",
    "error_stats",
    "gemm_block_scaled_reference",
    "gemm_reference",
    "grid_values",
    "hadamard_matrix",
    "inverse_rht",
    "k_segments",
    "max_exponent",
    "max_finite",
    "nan_code",
    "pack",
    "packed_cols",
    "philox4x32",
    "quantize",
    "random_bits",
    "random_words",
    "resolve_format",
    "resolve_rht",
    "rht",
    "rht_matrix",
    "rht_scale",
    "rht_signs",
    "swizzle_scales",
    "swizzled_size",
    "unpack",
    "unswizzle_scales",
]
