"""vLLM's CPU build as on an AVX2-only x86 CPU (`make test ISA=avx2`, through `python` beside this file): vLLM picks
its kernel library and attention / GEMM paths from these torch.cpu hardware queries (no setting overrides them), so
they answer False here and it loads its AVX2 library (_C_AVX2) and takes the paths an AVX2 CPU takes. torch's own,
oneDNN's and MKL's kernels are held to AVX2 by the variables `python` sets."""

import torch.cpu as _cpu

for _name in ("_is_avx512_supported", "_is_avx512_vnni_supported", "_is_avx512_bf16_supported",
              "_is_amx_tile_supported", "_is_amx_fp16_supported"):
    if hasattr(_cpu, _name):
        setattr(_cpu, _name, lambda: False)
