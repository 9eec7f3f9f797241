// Test fixture shared by the test programs (tests/*/): a fresh, uniquely named folder under the
// system's temporary directory ($TMPDIR or /tmp), removed with everything in it when the
// fixture goes out of scope. mkdtemp makes the name unique across processes and calls, so ranks
// and parallel ctest runs never share one.
#pragma once

#include <ftw.h>
#include <stdio.h>   // remove
#include <stdlib.h>  // mkdtemp

#include <filesystem>
#include <stdexcept>
#include <string>

namespace colossal::tests {

class TempDir {
 public:
  explicit TempDir(const std::string& prefix = "colossal_test") {
    std::string tmpl = (std::filesystem::temp_directory_path() / (prefix + "_XXXXXX")).string();
    if (::mkdtemp(tmpl.data()) == nullptr)
      throw std::runtime_error("TempDir: cannot create a folder like " + tmpl);
    path_ = tmpl;
  }
  // POSIX nftw, children first, links not followed: std::filesystem::remove_all crashes when
  // linked against this LibTorch (the wheel's libtorch.so exports a clashing copy of it).
  // Best effort: a failed removal must not fail the test.
  ~TempDir() {
    ::nftw(
        path_.c_str(),
        [](const char* p, const struct stat*, int, struct FTW*) {
          ::remove(p);
          return 0;  // go on with the rest
        },
        16, FTW_DEPTH | FTW_PHYS);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;

  const std::filesystem::path& path() const { return path_; }
  // The path of `name` inside the folder (not created).
  std::string file(const std::string& name) const { return (path_ / name).string(); }

 private:
  std::filesystem::path path_;
};

}  // namespace colossal::tests
