// The few file operations of the programs and tests that link libtorch, on POSIX calls rather than
// std::filesystem: pip's libtorch.so exports its own copies of std::filesystem's functions (its
// toolchain's libstdc++_nonshared), and a program linked against it binds to those ahead of
// libstdc++'s; on the H200 machines (torch 2.11) std::filesystem::remove_all there jumped to a null
// address (issue 46). tests/train/check_no_std_filesystem.sh keeps std::filesystem out.
#pragma once
#include <ftw.h>
#include <sys/stat.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <stdexcept>
#include <string>

namespace epmoe::files {

inline std::string join(const std::string& dir, const std::string& name) {
  if (dir.empty()) return name;
  return dir.back() == '/' ? dir + name : dir + "/" + name;
}

inline bool exists(const std::string& path) {
  struct stat st;
  return ::stat(path.c_str(), &st) == 0;
}

[[noreturn]] inline void fail_errno(const std::string& what, const std::string& path) {
  throw std::runtime_error(what + " " + path + ": " + std::strerror(errno));
}

// mkdir -p: every missing folder of `dir`; an existing non-folder is an error.
inline void make_dirs(const std::string& dir) {
  if (dir.empty()) return;
  for (size_t at = dir.find('/', 1);; at = dir.find('/', at + 1)) {
    const std::string part = at == std::string::npos ? dir : dir.substr(0, at);
    if (::mkdir(part.c_str(), 0777) != 0 && errno != EEXIST) fail_errno("cannot create the folder", part);
    if (at == std::string::npos) break;
  }
  struct stat st;
  if (::stat(dir.c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) fail_errno("not a folder:", dir);
}

// Atomic within one file system: a reader sees the old file or the new one.
inline void rename(const std::string& from, const std::string& to) {
  if (std::rename(from.c_str(), to.c_str()) != 0) fail_errno("cannot rename " + from + " to", to);
}

// rm -rf: `path` and everything under it (symbolic links are removed, not followed); no error when
// it does not exist.
inline void remove_tree(const std::string& path) {
  if (!exists(path)) return;
  auto remove_one = [](const char* p, const struct stat*, int, struct FTW*) { return std::remove(p) == 0 ? 0 : -1; };
  if (::nftw(path.c_str(), remove_one, 16, FTW_DEPTH | FTW_PHYS) != 0) fail_errno("cannot remove", path);
}

}  // namespace epmoe::files
