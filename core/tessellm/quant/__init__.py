"""Packed (quantized) weight formats and their quantizers."""
from tessellm.quant.formats import (
    FORMATS_BY_NAME, PACKED_FORMATS, Q4_0, Q4_1, Q4_K, Q5_0, Q5_1, Q5_K, Q6_K, Q8_0, QUANTIZABLE,
    PackedFormat, PackedWeight, concat_rows, dequantize, packed_example, packed_format, quantize,
    random_packed, row_bytes,
)

__all__ = ["FORMATS_BY_NAME", "PACKED_FORMATS", "Q4_0", "Q4_1", "Q4_K", "Q5_0", "Q5_1", "Q5_K",
           "Q6_K", "Q8_0", "QUANTIZABLE", "PackedFormat", "PackedWeight", "concat_rows",
           "dequantize", "packed_example", "packed_format", "quantize", "random_packed",
           "row_bytes"]
