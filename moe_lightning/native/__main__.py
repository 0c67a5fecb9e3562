"""`python -m moe_lightning.native`: builds the native kernels now (make dev and make install run it)
and says which decode attention and expert GEMMs run; exits 0 either way, since the PyTorch path still
serves."""

from moe_lightning.native import build_all

kernel, gemm = build_all()
print(f"decode attention: native ({kernel.isa})" if kernel is not None else "decode attention: pytorch (see the log)")
print(f"expert GEMMs: native ({gemm.isa})" if gemm is not None else "expert GEMMs: pytorch (see the log)")
