// Which CUDA device this process uses: one rank per GPU, chosen from what the launcher says about
// the rank's place on its node. Launchers name it differently (torchrun: LOCAL_RANK; Open MPI:
// OMPI_COMM_WORLD_LOCAL_RANK; MPICH/Intel MPI: MPI_LOCALRANKID; Slurm: SLURM_LOCALID); without
// any, the rank within the node's shared-memory MPI split; without MPI, device 0.
#include <cuda_runtime.h>

#include <charconv>
#include <cstdlib>
#include <string>

#include "comm/nccl_comm.h"
#include "epmoe/error.h"

namespace epmoe {
namespace {

int visible_device_count() {
  int count = 0;
  const cudaError_t e = cudaGetDeviceCount(&count);
  if (e != cudaSuccess)
    EPMOE_FAIL(ErrorCode::cuda_error, "cudaGetDeviceCount failed: ", cudaGetErrorName(e), ": ", cudaGetErrorString(e));
  EPMOE_CHECK(count > 0, ErrorCode::cuda_error, "no CUDA device is visible");
  return count;
}

// `source` names where the index came from, for the message.
int checked_local_index(int index, const std::string& source, int count) {
  EPMOE_CHECK(index < count, ErrorCode::invalid_config, source, " but only ", count,
              " CUDA devices are visible (when each process sees only its own GPU, set NcclCommOptions::device)");
  return index;
}

int parse_local_rank(const char* name, const std::string& value) {
  int index = -1;
  const char* first = value.data();
  const char* last = first + value.size();
  const auto [end, ec] = std::from_chars(first, last, index);
  EPMOE_CHECK(ec == std::errc() && end == last && index >= 0, ErrorCode::invalid_config, name, "='", value,
              "' is not a non-negative integer");
  return index;
}

// The index the launcher's variable gives (the first one set), with `source` set for messages;
// -1 when none is set.
int launcher_local_rank(std::string& source) {
  static const char* const kVars[] = {"LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "SLURM_LOCALID"};
  for (const char* var : kVars) {
    const char* v = std::getenv(var);
    if (v == nullptr || *v == '\0') continue;
    const std::string value = v;
    source = std::string(var) + "=" + value;
    return parse_local_rank(var, value);
  }
  return -1;
}

#if EPMOE_WITH_MPI
// -1 when MPI is not usable (not initialized, or finalized).
int mpi_node_local_rank(MPI_Comm scope) {
  int initialized = 0, finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  if (!initialized || finalized) return -1;
  MPI_Comm node = MPI_COMM_NULL;
  int rank = 0;
  EPMOE_CHECK(MPI_Comm_split_type(scope, MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &node) == MPI_SUCCESS,
              ErrorCode::comm_error, "MPI_Comm_split_type(MPI_COMM_TYPE_SHARED) failed");
  MPI_Comm_rank(node, &rank);
  MPI_Comm_free(&node);
  return rank;
}
#endif

// The index comes first, the device count second: the MPI fallback is collective, and a rank must
// not skip it because of a local CUDA failure (the others would wait in the split forever).
int device_for(int index, const std::string& source) {
  const int count = visible_device_count();
  return index < 0 ? 0 : checked_local_index(index, source, count);
}

}  // namespace

#if EPMOE_WITH_MPI
int select_local_device_for(MPI_Comm node_scope) {
  std::string source;
  int index = launcher_local_rank(source);
  if (index < 0) {
    index = mpi_node_local_rank(node_scope);
    source = "the node-local MPI rank is " + std::to_string(index);
  }
  return device_for(index, source);
}
#endif

int select_local_device() {
#if EPMOE_WITH_MPI
  return select_local_device_for(MPI_COMM_WORLD);
#else
  std::string source;
  const int index = launcher_local_rank(source);
  return device_for(index, source);
#endif
}

}  // namespace epmoe
