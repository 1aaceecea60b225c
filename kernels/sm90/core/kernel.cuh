// The skeleton every sm_90a kernel of the core instantiates: 384 threads in three warpgroups, the
// first the producer (TMA loads, row gathers, and in DOWN the reducers of the staged epilogue), the
// other two the consumers (the MMAs on the ring, and the epilogue). setmaxnreg moves registers from
// the producer warpgroup to the consumers, whose accumulators need them.
#pragma once
#include <cstdint>

#include "kernels/sm90/core/ptx.cuh"

namespace epmoe::kernels::sm90 {
#if EPMOE_SM90A_DEVICE

// Runs producer() on warpgroup 0 and consumer(c) on warpgroups 1 + c (c = 0, 1: tile rows [64c, +64)),
// after moving registers between them. All 384 threads call it; c is warp-uniform.
template <uint32_t kProducerRegs, uint32_t kConsumerRegs, class Producer, class Consumer>
__device__ __forceinline__ void run_warp_roles(Producer&& producer, Consumer&& consumer) {
  static_assert(setmaxnreg_split_fits(kProducerRegs, kConsumerRegs),
                "the consumers would wait forever in setmaxnreg.inc");
  const int wg = warpgroup_index();
  if (wg == 0) {
    setmaxnreg_dec<kProducerRegs>();
    producer();
  } else {
    setmaxnreg_inc<kConsumerRegs>();
    consumer(wg - 1);
  }
}

#endif  // EPMOE_SM90A_DEVICE
}  // namespace epmoe::kernels::sm90
