// Messages between processes for the emulated NCCL (nccl.cc): frames of
// bytes over Unix-domain sockets in Linux's abstract namespace, and the
// fields inside a frame. Nothing here knows NCCL; nccl.cc says what the
// frames mean.
//
// A frame is an 8-byte little-endian length and that many bytes. Every
// wait has a deadline: a peer process that stops answering is an error,
// not a hang.
#ifndef PLATEAU_KERNELS_CUDA_EMULATED_WIRE_H_
#define PLATEAU_KERNELS_CUDA_EMULATED_WIRE_H_

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <string>

namespace plateau::cuda_emulation::wire {

using Clock = std::chrono::steady_clock;

// Fields appended in order; Reader takes them back in the same order.
class Writer {
 public:
  Writer& U32(uint32_t v);
  Writer& U64(uint64_t v);
  // A length, then the bytes.
  Writer& Bytes(const void* data, size_t n);
  Writer& Str(const std::string& s) { return Bytes(s.data(), s.size()); }
  std::string Take() { return std::move(out_); }

 private:
  std::string out_;
};

// Each getter returns false once the frame is shorter than what is asked
// (a malformed frame), and from then on.
class Reader {
 public:
  explicit Reader(const std::string& frame) : in_(frame) {}
  bool U32(uint32_t* v);
  bool U64(uint64_t* v);
  bool Str(std::string* s);
  bool AtEnd() const { return ok_ && at_ == in_.size(); }

 private:
  bool Take(void* out, size_t n);
  const std::string& in_;
  size_t at_ = 0;
  bool ok_ = true;
};

// A listening socket at the abstract address `name` (no leading NUL: it is
// added). Returns the descriptor, or -1 with *why set.
int Listen(const std::string& name, std::string* why);
// The next connection on `listener` (blocks) from a process of this user
// (others are closed unanswered: an abstract socket has no file
// permissions); -1 on error.
int Accept(int listener);
// A connection to `name`; -1 with *why set (nobody listens there: the
// process has exited).
int Connect(const std::string& name, std::string* why);
void Close(int fd);
// Ends both directions of `fd` now (a thread blocked on it returns); the
// descriptor stays open until Close.
void Shutdown(int fd);

// Sends one frame before `deadline`; false with *why set if the peer has
// gone or stopped reading.
bool Send(int fd, const std::string& frame, Clock::time_point deadline, std::string* why);
// Receives one frame of at most `max_bytes`, waiting until `deadline`;
// false with *why set on end of stream, error, timeout or a longer frame.
bool Receive(int fd, std::string* frame, Clock::time_point deadline, std::string* why,
             uint64_t max_bytes = uint64_t{1} << 36);

}  // namespace plateau::cuda_emulation::wire

#endif  // PLATEAU_KERNELS_CUDA_EMULATED_WIRE_H_
