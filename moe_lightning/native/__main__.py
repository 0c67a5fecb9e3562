"""`python -m moe_lightning.native`: builds the native kernels now (make dev and make install run it)
and says which decode attention and expert GEMMs run; exits 0 either way, since the PyTorch path still
serves."""

from moe_lightning.native import decode_kernel, expert_kernel

kernel = decode_kernel()
print(f"decode attention: native ({kernel.isa})" if kernel is not None else "decode attention: pytorch (see the log)")
gemm = expert_kernel()
print(f"expert GEMMs: native ({gemm.isa})" if gemm is not None else "expert GEMMs: pytorch (see the log)")
