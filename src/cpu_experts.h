// CPU expert compute: the destination side of the EP forward on the host.
//   x[rows, hidden] bf16 received rows, meta[rows, meta_words] ->
//   out[rows, hidden] bf16 = bf16( sum over the row's local experts e of w * W2_e act_e(x) )
//   act_e(x) = bf16( silu(W1gate_e x) * (W1up_e x) )      fp32 accumulation throughout
#pragma once
#include <cstdint>

#include "ep_protocol.h"

namespace epmoe {

class CpuExperts {
 public:
  // w1[E_local, 2*ffn, hidden], w2[E_local, hidden, ffn] (bf16, host). Not copied: must outlive this.
  CpuExperts(const MoeConfig& cfg, const bf16* w1, const bf16* w2, int threads);
  void run(const bf16* x, const int32_t* meta, int64_t rows, bf16* out) const;

 private:
  void run_expert(int e, const bf16* x, const protocol::ExpertLayout& L, float* acc) const;
  MoeConfig cfg_;
  const bf16* w1_;
  const bf16* w2_;
  int threads_;
};

}  // namespace epmoe
