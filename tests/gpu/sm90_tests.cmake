# The sm_90a split expert pipeline suite (label gpu; skips without a compute capability 9.0 device).
epmoe_gpu_test(test_sm90_experts test_sm90_experts.cu sm90_case.cu sm90_variants.cu)
# The kernel core alone: a dense GEMM on its ring, mainloop and tiles, each operand K- or MN-major.
epmoe_gpu_test(test_sm90_core test_sm90_core.cu)
# The core's FP8 wgmma (m64n128k32 e4m3) with MX promotion, against an fp64 product (issue 50).
epmoe_gpu_test(test_sm90_fp8_core test_sm90_fp8_core.cu)
# The MX swap-AB pipeline (E4M3 + E8M0, requantized act) against a host reference (issue 50).
epmoe_gpu_test(test_sm90_mx_swap test_sm90_mx_swap.cu)
# The FP8 block-128 tile form (E4M3 + fp32 1x128 / 128x128 block scales) against a host reference (issue 50).
epmoe_gpu_test(test_sm90_fp8b_tile test_sm90_fp8b_tile.cu)
