// A fresh SQLite database path for a store test: under $TEST_TMPDIR, or a
// directory of this process's own when run by hand, so tests never share one.
#ifndef PLATEAU_SERVER_TEST_DB_H_
#define PLATEAU_SERVER_TEST_DB_H_

#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <string>

namespace plateau {

inline std::string TempDb(const std::string& name) {
  const char* tmp = std::getenv("TEST_TMPDIR");
  std::string dir = (tmp ? std::string(tmp) : "/tmp/plateau-test-" + std::to_string(getpid())) + "/" + name;
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  return dir + "/state.db";
}

}  // namespace plateau

#endif  // PLATEAU_SERVER_TEST_DB_H_
