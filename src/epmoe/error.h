// One error type for the whole library. Every failure that a caller can act on is an
// epmoe::Error with a code; EPMOE_CHECK adds the call site so messages say where.
#pragma once
#include <sstream>
#include <stdexcept>
#include <string>

namespace epmoe {

enum class ErrorCode : int {
  ok = 0,
  invalid_config = 1,        // MoeConfig fails validation
  config_mismatch = 2,       // ranks disagree on the configuration
  invalid_argument = 3,      // shape / dtype / device / alignment of a tensor argument
  expert_id_out_of_range = 4,
  duplicate_expert_id = 5,
  remote_error = 6,          // (unused as a status) a peer reported an error
  comm_error = 7,            // MPI / NCCL / transport failure
  cuda_error = 8,
  timeout = 9,               // a collective did not complete within the deadline
  unsupported = 10,
  internal = 11,
};

const char* error_code_name(ErrorCode c);

class Error : public std::runtime_error {
 public:
  Error(ErrorCode code, const std::string& what) : std::runtime_error(what), code_(code) {}
  ErrorCode code() const { return code_; }

 private:
  ErrorCode code_;
};

namespace detail {
template <class... A>
std::string concat(const A&... a) {
  std::ostringstream os;
  (os << ... << a);
  return os.str();
}
[[noreturn]] void throw_error(ErrorCode code, const char* file, int line, const std::string& msg);
}  // namespace detail

}  // namespace epmoe

// EPMOE_CHECK(cond, code, parts...) -> throws epmoe::Error("[code] parts... (file:line)")
#define EPMOE_CHECK(cond, code, ...)                                                              \
  do {                                                                                            \
    if (!(cond)) ::epmoe::detail::throw_error((code), __FILE__, __LINE__, ::epmoe::detail::concat(__VA_ARGS__)); \
  } while (0)
#define EPMOE_FAIL(code, ...) ::epmoe::detail::throw_error((code), __FILE__, __LINE__, ::epmoe::detail::concat(__VA_ARGS__))
