"""Packed (quantized) weight formats and their quantizers."""
from tessellm.quant.formats import (
    FORMATS_BY_NAME, PACKED_FORMATS, Q4_0, Q4_1, Q8_0, PackedFormat, PackedWeight, concat_rows,
    dequantize, packed_format, quantize, row_bytes,
)

__all__ = ["FORMATS_BY_NAME", "PACKED_FORMATS", "Q4_0", "Q4_1", "Q8_0", "PackedFormat",
           "PackedWeight", "concat_rows", "dequantize", "packed_format", "quantize", "row_bytes"]
