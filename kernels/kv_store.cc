#include "kernels/kv_store.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <filesystem>
#include <random>
#include <system_error>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace plateau {
namespace {

// Longest escaped key kept verbatim in a file name (NAME_MAX is 255).
constexpr size_t kMaxVerbatimName = 160;

uint64_t Fnv1a64(const std::string& s) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (unsigned char c : s) {
    h ^= c;
    h *= 0x100000001b3ull;
  }
  return h;
}

std::string EscapeKey(const std::string& key) {
  std::string out;
  out.reserve(key.size());
  for (unsigned char c : key) {
    if ((c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') ||
        (c >= '0' && c <= '9') || c == '.' || c == '_' || c == '-') {
      out.push_back(static_cast<char>(c));
    } else {
      absl::StrAppendFormat(&out, "%%%02X", c);
    }
  }
  if (out.size() > kMaxVerbatimName) {
    out.resize(kMaxVerbatimName);
    absl::StrAppendFormat(&out, "~%016x", Fnv1a64(key));
  }
  return out;
}

absl::Status ErrnoError(int err, absl::string_view what,
                        absl::string_view path) {
  std::string msg = absl::StrCat("file_store: ", what, " '", path,
                                 "': ", strerror(err));
  switch (err) {
    case EACCES:
    case EPERM:
    case EROFS:
      return absl::PermissionDeniedError(msg);
    case ENOSPC:
    case EDQUOT:
      return absl::ResourceExhaustedError(msg);
    case ENOENT:
    case ENOTDIR:
      return absl::NotFoundError(msg);
    default:
      return absl::UnavailableError(msg);
  }
}

absl::Status WriteAll(int fd, const std::string& data,
                      const std::string& path) {
  size_t done = 0;
  while (done < data.size()) {
    ssize_t n = ::write(fd, data.data() + done, data.size() - done);
    if (n < 0) {
      if (errno == EINTR) continue;
      return ErrnoError(errno, "write", path);
    }
    done += static_cast<size_t>(n);
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<FileStore>> FileStore::Create(
    const std::string& directory) {
  if (directory.empty()) {
    return absl::InvalidArgumentError("file_store: directory is empty");
  }
  std::error_code ec;
  std::filesystem::create_directories(directory, ec);
  if (ec) {
    return absl::UnavailableError(absl::StrCat(
        "file_store: cannot create directory '", directory, "': ",
        ec.message()));
  }
  if (!std::filesystem::is_directory(directory, ec)) {
    return absl::FailedPreconditionError(absl::StrCat(
        "file_store: '", directory, "' is not a directory"));
  }
  return std::unique_ptr<FileStore>(new FileStore(directory));
}

std::string FileStore::PathOf(const std::string& key) const {
  // "k_" keeps key files apart from the "t_" temporaries and from "."/"..".
  return absl::StrCat(directory_, "/k_", EscapeKey(key));
}

std::string FileStore::TemporaryName() {
  static std::atomic<uint64_t> counter{0};
  // Host names may hold characters we keep out of file names, and may be
  // long: a few safe characters of it, for whoever lists the directory.
  static const std::string host = [] {
    char buf[256] = {};
    if (::gethostname(buf, sizeof(buf) - 1) != 0) return std::string("host");
    std::string h;
    for (const char* c = buf; *c != '\0' && h.size() < 32; ++c) {
      const bool safe = (*c >= 'A' && *c <= 'Z') || (*c >= 'a' && *c <= 'z') || (*c >= '0' && *c <= '9') || *c == '-';
      h.push_back(safe ? *c : '-');
    }
    return h.empty() ? std::string("host") : h;
  }();
  // Per thread, seeded from the OS: processes that share a pid and a host
  // name (containers) still draw different bits.
  thread_local std::mt19937_64 random([] {
    std::random_device device;
    return (static_cast<uint64_t>(device()) << 32) ^ device();
  }());
  return absl::StrFormat("t_%s_%d_%016x_%d", host, static_cast<int>(::getpid()), random(), counter.fetch_add(1));
}

absl::Status FileStore::Set(const std::string& key, const std::string& value) {
  // A temporary of its own per call, so concurrent writers of the same key
  // never share one; rename() then publishes one of them whole. A name that
  // is taken (EEXIST: another writer's temporary) is never touched: Set
  // takes another.
  constexpr int kAttempts = 8;
  std::string tmp;
  int fd = -1;
  for (int attempt = 1; fd < 0; ++attempt) {
    tmp = absl::StrCat(directory_, "/", temporary_names_());
    fd = ::open(tmp.c_str(), O_CREAT | O_EXCL | O_WRONLY | O_CLOEXEC, 0644);
    if (fd < 0 && (errno != EEXIST || attempt == kAttempts)) {
      const absl::Status s = ErrnoError(errno, "create", tmp);
      return absl::Status(s.code(), absl::StrCat(s.message(), " (setting key '", key, "')"));
    }
  }
  absl::Status s = WriteAll(fd, value, tmp);
  if (::close(fd) != 0 && s.ok()) s = ErrnoError(errno, "close", tmp);
  const std::string path = PathOf(key);
  if (s.ok() && ::rename(tmp.c_str(), path.c_str()) != 0) {
    s = ErrnoError(errno, "rename to", path);
  }
  if (!s.ok()) {
    ::unlink(tmp.c_str());
    return absl::Status(s.code(),
                        absl::StrCat(s.message(), " (setting key '", key, "')"));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::string> FileStore::TryRead(const std::string& key) const {
  const std::string path = PathOf(key);
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    if (errno == ENOENT) {
      return absl::NotFoundError(absl::StrCat("file_store: key '", key,
                                              "' is not set"));
    }
    return ErrnoError(errno, "open", path);
  }
  std::string value;
  char buf[4096];
  for (;;) {
    ssize_t n = ::read(fd, buf, sizeof(buf));
    if (n < 0) {
      if (errno == EINTR) continue;
      int err = errno;
      ::close(fd);
      return ErrnoError(err, "read", path);
    }
    if (n == 0) break;
    value.append(buf, static_cast<size_t>(n));
  }
  ::close(fd);
  return value;
}

absl::StatusOr<std::string> FileStore::Get(const std::string& key,
                                           absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  absl::Duration backoff = absl::Milliseconds(1);
  for (;;) {
    absl::StatusOr<std::string> v = TryRead(key);
    if (v.ok() || !absl::IsNotFound(v.status())) return v;
    const absl::Time now = absl::Now();
    if (now >= deadline) {
      return absl::DeadlineExceededError(absl::StrCat(
          "file_store: key '", key, "' was not set within ",
          absl::FormatDuration(timeout), " (directory ", directory_, ")"));
    }
    absl::SleepFor(std::min(backoff, deadline - now));
    backoff = std::min(backoff * 2, absl::Milliseconds(20));
  }
}

absl::StatusOr<bool> FileStore::Check(const std::vector<std::string>& keys) {
  for (const std::string& key : keys) {
    const std::string path = PathOf(key);
    struct stat st;
    if (::stat(path.c_str(), &st) != 0) {
      if (errno == ENOENT) return false;
      return ErrnoError(errno, "stat", path);
    }
  }
  return true;
}

}  // namespace plateau
