// Slot pack kernel (see capacity_slots.cuh): one warp per send row, 16-byte vectors.
#include "kernels/cuda_check.cuh"
#include "kernels/ep/capacity_slots.cuh"

namespace epmoe::kernels {

namespace {

constexpr int kWarpsPerBlock = 8;

__global__ void slot_pack_kernel(SlotPackArgs a) {
  const int64_t r = int64_t(blockIdx.x) * kWarpsPerBlock + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (r >= a.send_offsets[a.world]) return;  // warp-uniform
  int p = 0;
  while (p + 1 < a.world && a.send_offsets[p + 1] <= r) ++p;
  const int64_t dst = int64_t(p) * a.slot_rows + (r - a.send_offsets[p]);
  const int32_t t = a.send_token[r];
  const int64_t vecs = a.row_bytes / 16;
  const uint4* src = reinterpret_cast<const uint4*>(a.x) + int64_t(t) * vecs;
  uint4* out = reinterpret_cast<uint4*>(a.send_x) + dst * vecs;
  for (int64_t v = lane; v < vecs; v += 32) out[v] = __ldg(src + v);
  for (int w = lane; w < a.meta_words; w += 32)
    a.send_meta_slots[dst * a.meta_words + w] = a.send_meta[r * a.meta_words + w];
  if (lane == 0) a.token_row[int64_t(t) * a.world + p] = int32_t(dst);
}

}  // namespace

void slot_pack_launch(const SlotPackArgs& a, cudaStream_t stream) {
  if (a.max_rows <= 0) return;
  EPMOE_CHECK(a.row_bytes > 0 && a.row_bytes % 16 == 0 && a.world >= 1 && a.world <= 64 &&
                  int64_t(a.world) * a.slot_rows < INT32_MAX,
              ErrorCode::internal, "slot_pack: row_bytes ", a.row_bytes, " world ", a.world, " slot_rows ", a.slot_rows);
  const int64_t blocks = (a.max_rows + kWarpsPerBlock - 1) / kWarpsPerBlock;
  slot_pack_kernel<<<unsigned(blocks), kWarpsPerBlock * 32, 0, stream>>>(a);
  EPMOE_CUDA_CHECK_LAUNCH("slot_pack_kernel");
}

}  // namespace epmoe::kernels
