#include "epmoe/error.h"

#include <cstring>

namespace epmoe {

const char* error_code_name(ErrorCode c) {
  switch (c) {
    case ErrorCode::ok: return "ok";
    case ErrorCode::invalid_config: return "invalid_config";
    case ErrorCode::config_mismatch: return "config_mismatch";
    case ErrorCode::invalid_argument: return "invalid_argument";
    case ErrorCode::expert_id_out_of_range: return "expert_id_out_of_range";
    case ErrorCode::duplicate_expert_id: return "duplicate_expert_id";
    case ErrorCode::remote_error: return "remote_error";
    case ErrorCode::comm_error: return "comm_error";
    case ErrorCode::cuda_error: return "cuda_error";
    case ErrorCode::timeout: return "timeout";
    case ErrorCode::unsupported: return "unsupported";
    case ErrorCode::internal: return "internal";
  }
  return "unknown";
}

namespace detail {
[[noreturn]] void throw_error(ErrorCode code, const char* file, int line, const std::string& msg) {
  const char* base = std::strrchr(file, '/');
  throw Error(code, concat("epmoe: [", error_code_name(code), "] ", msg, " (", base ? base + 1 : file, ":", line, ")"));
}
}  // namespace detail

}  // namespace epmoe
