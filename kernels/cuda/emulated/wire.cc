#include "kernels/cuda/emulated/wire.h"

#include <poll.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

namespace plateau::cuda_emulation::wire {
namespace {

void PutLittleEndian(std::string* out, uint64_t v, int bytes) {
  for (int i = 0; i < bytes; ++i) out->push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}

uint64_t GetLittleEndian(const unsigned char* p, int bytes) {
  uint64_t v = 0;
  for (int i = 0; i < bytes; ++i) v |= static_cast<uint64_t>(p[i]) << (8 * i);
  return v;
}

// The abstract address: a NUL, then the name (not a file: nothing to
// clean up, and it vanishes with the process).
socklen_t Address(const std::string& name, sockaddr_un* addr) {
  std::memset(addr, 0, sizeof(*addr));
  addr->sun_family = AF_UNIX;
  const size_t n = std::min(name.size(), sizeof(addr->sun_path) - 1);
  std::memcpy(addr->sun_path + 1, name.data(), n);
  return static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + n);
}

std::string Errno(const char* call) { return std::string(call) + ": " + std::strerror(errno); }

}  // namespace

Writer& Writer::U32(uint32_t v) {
  PutLittleEndian(&out_, v, 4);
  return *this;
}

Writer& Writer::U64(uint64_t v) {
  PutLittleEndian(&out_, v, 8);
  return *this;
}

Writer& Writer::Bytes(const void* data, size_t n) {
  U64(n);
  out_.append(static_cast<const char*>(data), n);
  return *this;
}

bool Reader::Take(void* out, size_t n) {
  if (!ok_ || in_.size() - at_ < n) return ok_ = false;
  std::memcpy(out, in_.data() + at_, n);
  at_ += n;
  return true;
}

bool Reader::U32(uint32_t* v) {
  unsigned char b[4];
  if (!Take(b, 4)) return false;
  *v = static_cast<uint32_t>(GetLittleEndian(b, 4));
  return true;
}

bool Reader::U64(uint64_t* v) {
  unsigned char b[8];
  if (!Take(b, 8)) return false;
  *v = GetLittleEndian(b, 8);
  return true;
}

bool Reader::Str(std::string* s) {
  uint64_t n = 0;
  if (!U64(&n)) return false;
  if (in_.size() - at_ < n) return ok_ = false;
  s->assign(in_.data() + at_, n);
  at_ += n;
  return true;
}

int Listen(const std::string& name, std::string* why) {
  const int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) {
    *why = Errno("socket");
    return -1;
  }
  sockaddr_un addr;
  const socklen_t len = Address(name, &addr);
  if (bind(fd, reinterpret_cast<sockaddr*>(&addr), len) != 0 || listen(fd, 64) != 0) {
    *why = Errno("bind/listen");
    close(fd);
    return -1;
  }
  return fd;
}

int Accept(int listener) {
  for (;;) {
    const int fd = accept4(listener, nullptr, nullptr, SOCK_CLOEXEC);
    if (fd < 0 && errno == EINTR) continue;
    if (fd < 0) return fd;
    ucred peer{};
    socklen_t len = sizeof(peer);
    if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &peer, &len) == 0 && peer.uid == getuid()) {
      return fd;
    }
    close(fd);
  }
}

int Connect(const std::string& name, std::string* why) {
  const int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) {
    *why = Errno("socket");
    return -1;
  }
  sockaddr_un addr;
  const socklen_t len = Address(name, &addr);
  int r;
  do {
    r = connect(fd, reinterpret_cast<sockaddr*>(&addr), len);
  } while (r != 0 && errno == EINTR);
  if (r != 0) {
    *why = Errno("connect");
    close(fd);
    return -1;
  }
  return fd;
}

void Close(int fd) {
  if (fd >= 0) close(fd);
}

void Shutdown(int fd) {
  if (fd >= 0) shutdown(fd, SHUT_RDWR);
}

namespace {

// Waits until `fd` is ready for `events` or `deadline` passes (a last
// zero-timeout look when it has). 1: ready, 0: timed out, -1: error.
int WaitReady(int fd, short events, Clock::time_point deadline, std::string* why) {
  for (;;) {
    const auto left =
        std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
    pollfd p{fd, events, 0};
    const int ready = poll(&p, 1, static_cast<int>(std::clamp<long long>(left, 0, 1000)));
    if (ready < 0 && errno == EINTR) continue;
    if (ready < 0) {
      *why = Errno("poll");
      return -1;
    }
    if (ready > 0) return 1;
    if (left <= 0) {
      *why = "no answer before the deadline";
      return 0;
    }
  }
}

}  // namespace

bool Send(int fd, const std::string& frame, Clock::time_point deadline, std::string* why) {
  std::string out;
  PutLittleEndian(&out, frame.size(), 8);
  out += frame;
  size_t at = 0;
  while (at < out.size()) {
    if (WaitReady(fd, POLLOUT, deadline, why) != 1) {
      if (*why == "no answer before the deadline") *why = "the peer stopped reading";
      return false;
    }
    // MSG_NOSIGNAL: a peer that has gone is an error here, not SIGPIPE.
    const ssize_t n = send(fd, out.data() + at, out.size() - at, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n < 0 && (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK)) continue;
    if (n <= 0) {
      *why = Errno("send");
      return false;
    }
    at += static_cast<size_t>(n);
  }
  return true;
}

namespace {

// Reads exactly n bytes before `deadline`. *got counts what arrived.
bool ReadFully(int fd, char* out, size_t n, Clock::time_point deadline, std::string* why,
               size_t* got) {
  *got = 0;
  while (*got < n) {
    if (WaitReady(fd, POLLIN, deadline, why) != 1) return false;
    const ssize_t r = recv(fd, out + *got, n - *got, MSG_DONTWAIT);
    if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) continue;
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) {
      *why = Errno("recv");
      return false;
    }
    if (r == 0) {
      *why = "the connection was closed";
      return false;
    }
    *got += static_cast<size_t>(r);
  }
  return true;
}

}  // namespace

bool Receive(int fd, std::string* frame, Clock::time_point deadline, std::string* why,
             uint64_t max_bytes) {
  char header[8];
  size_t got = 0;
  if (!ReadFully(fd, header, sizeof(header), deadline, why, &got)) return false;
  const uint64_t n = GetLittleEndian(reinterpret_cast<unsigned char*>(header), 8);
  if (n > max_bytes) {
    *why = "a frame of " + std::to_string(n) + " bytes, more than " + std::to_string(max_bytes);
    return false;
  }
  frame->resize(n);
  return ReadFully(fd, frame->data(), n, deadline, why, &got);
}

}  // namespace plateau::cuda_emulation::wire
