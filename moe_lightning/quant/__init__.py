"""Quantized expert pages: formats (scheme, no torch), round-to-nearest (rtn), GPTQ checkpoints (gptq),
the quantized linears and their kernels (kernels), which format a stack runs (resolve)."""
