#include "worker/data.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <numeric>
#include <utility>

#include "absl/strings/str_cat.h"
#include "kernels/model/config.h"
#include "kernels/model/init.h"
#include "kernels/status_macros.h"
#include "worker/file_errors.h"

namespace plateau {
namespace {

constexpr int32_t kShardMagic = 20240520;
constexpr int64_t kShardHeaderInts = 256;

// `h` carried over n tokens by value, each mixed in (Mix64): the recall
// task's split of its sequences, and the fingerprint of a token stream.
uint64_t HashTokens(uint64_t h, const int32_t* tok, int64_t n) {
  for (int64_t t = 0; t < n; ++t) h = Mix64(h ^ static_cast<uint64_t>(static_cast<uint32_t>(tok[t])));
  return h;
}

absl::Status CheckSlice(const DataSlice& s) {
  if (s.batch < 1) return absl::InvalidArgumentError(absl::StrCat("data.batch: expected >= 1, got ", s.batch));
  if (s.seq_len < 1) return absl::InvalidArgumentError(absl::StrCat("data.seq_len: expected >= 1, got ", s.seq_len));
  if (s.ranks < 1 || s.rank < 0 || s.rank >= s.ranks) {
    return absl::InvalidArgumentError(absl::StrCat("data.rank: expected 0 <= rank < ranks = ", s.ranks, ", got ", s.rank));
  }
  if (s.seq_len % s.ranks != 0) {
    return absl::InvalidArgumentError(absl::StrCat("data.seq_len: expected a multiple of ranks = ", s.ranks, ", got ", s.seq_len));
  }
  if (s.held_out < 0 || (s.validation && s.held_out == 0)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "data.held_out_sequences: expected >= 0 (and >= 1 to read the held-out split), got ", s.held_out));
  }
  return absl::OkStatus();
}

// A file descriptor that closes itself.
class File {
 public:
  explicit File(int fd = -1) : fd_(fd) {}
  ~File() { if (fd_ >= 0) close(fd_); }
  File(File&& o) noexcept : fd_(std::exchange(o.fd_, -1)) {}
  File& operator=(File&& o) noexcept { std::swap(fd_, o.fd_); return *this; }
  int fd() const { return fd_; }
 private:
  int fd_;
};

absl::Status ReadAt(int fd, const std::string& path, void* buf, size_t bytes, int64_t offset) {
  char* p = static_cast<char*>(buf);
  while (bytes > 0) {
    ssize_t n = pread(fd, p, bytes, offset);
    if (n < 0 && errno == EINTR) continue;
    // The file ends first: DATA_LOSS. A failed read: FileError (EIO, ESTALE
    // may pass and are retried).
    if (n < 0) return FileError(absl::StrCat(path, ": read failed at byte ", offset), errno);
    if (n == 0) return absl::DataLossError(absl::StrCat(path, ": short read at byte ", offset));
    p += n;
    bytes -= n;
    offset += n;
  }
  return absl::OkStatus();
}

// The concatenation of token files, read on demand.
class TokenStream final : public DataSource {
 public:
  struct Part {
    std::string path;
    File file;
    int64_t header_bytes;
    int64_t token_bytes;  // 1, 2 or 4
    int64_t count;
  };

  TokenStream(std::vector<Part> parts, int64_t vocab, const DataSlice& slice)
      : parts_(std::move(parts)), vocab_(vocab), slice_(slice) {
    for (const Part& p : parts_) total_ += p.count;
    const int64_t T = slice_.seq_len;
    if (slice_.held_out == 0) {
      sequences_ = (total_ - 1) / T;
      return;
    }
    // The held-out tokens are the last held_out * T + 1: sequence j of the
    // split is tokens [split + jT, split + jT + T]. The training sequences
    // read tokens below `split` only (the last one's target is token
    // split - 1 at most), so no token position is in both.
    const int64_t split = total_ - (slice_.held_out * T + 1);
    if (slice_.validation) {
      base_ = split;
      sequences_ = slice_.held_out;
    } else {
      sequences_ = split > 0 ? (split - 1) / T : 0;
    }
  }

  int64_t total() const { return total_; }
  int64_t stream_tokens() const override { return total_; }
  uint64_t stream_fingerprint() const override { return fingerprint_; }
  int64_t sequences() const { return sequences_; }
  int64_t vocab_size() const override { return vocab_; }
  uint64_t position() const override { return position_; }
  void Seek(uint64_t position) override { position_ = position; }

  absl::Status Next(Batch* out) override {
    const int64_t T = slice_.seq_len, n = T / slice_.ranks;
    out->tokens.resize(slice_.batch * n);
    out->targets.resize(slice_.batch * n);
    std::vector<int32_t> buf(n + 1);
    for (int64_t b = 0; b < slice_.batch; ++b) {
      const int64_t seq = static_cast<int64_t>((position_ + b) % sequences_);
      PLATEAU_RETURN_IF_ERROR(Read(base_ + seq * T + slice_.rank * n, n + 1, buf.data()));
      std::copy_n(buf.begin(), n, out->tokens.begin() + b * n);
      std::copy_n(buf.begin() + 1, n, out->targets.begin() + b * n);
    }
    position_ += slice_.batch;
    return absl::OkStatus();
  }

  // Reads the sample and hashes it (HashTokens, from the stream's length
  // on). The vocabulary is not checked here: a token outside it fails the
  // batch that reads it.
  absl::Status Fingerprint() {
    uint64_t h = Mix64(static_cast<uint64_t>(total_));
    std::vector<int32_t> window;
    for (const auto& [offset, count] : FingerprintSample(total_)) {
      window.resize(count);
      PLATEAU_RETURN_IF_ERROR(Read(offset, count, window.data(), /*check_vocab=*/false));
      h = HashTokens(h, window.data(), count);
    }
    fingerprint_ = h;
    return absl::OkStatus();
  }

 private:
  // Tokens [start, start + count) of the concatenated stream.
  absl::Status Read(int64_t start, int64_t count, int32_t* out, bool check_vocab = true) {
    size_t i = 0;
    while (i < parts_.size() && start >= parts_[i].count) start -= parts_[i++].count;
    std::vector<unsigned char> raw;
    while (count > 0) {
      if (i >= parts_.size()) return absl::InternalError("token stream: read past the end");
      Part& p = parts_[i];
      const int64_t take = std::min(count, p.count - start);
      raw.resize(take * p.token_bytes);
      PLATEAU_RETURN_IF_ERROR(ReadAt(p.file.fd(), p.path, raw.data(), raw.size(),
                                     p.header_bytes + start * p.token_bytes));
      for (int64_t j = 0; j < take; ++j) {
        uint32_t v = 0;
        std::memcpy(&v, &raw[j * p.token_bytes], p.token_bytes);  // little-endian
        if (check_vocab && v >= static_cast<uint64_t>(vocab_)) {
          return absl::DataLossError(absl::StrCat(p.path, ": token ", v, " at index ", start + j,
                                                  " is outside the vocabulary of ", vocab_));
        }
        out[j] = static_cast<int32_t>(v);
      }
      out += take;
      count -= take;
      start = 0;
      ++i;
    }
    return absl::OkStatus();
  }

  std::vector<Part> parts_;
  int64_t vocab_;
  DataSlice slice_;
  int64_t total_ = 0;
  int64_t base_ = 0;       // the first token of this split
  int64_t sequences_ = 0;  // sequences of this split (a stream wraps after them)
  uint64_t position_ = 0;
  uint64_t fingerprint_ = 0;
};

}  // namespace

std::vector<std::pair<int64_t, int64_t>> FingerprintSample(int64_t tokens) {
  constexpr int64_t kEnds = 4096, kWindows = 64, kWindow = 64;
  if (tokens <= 2 * kEnds + kWindows * kWindow) return {{0, tokens}};
  std::vector<std::pair<int64_t, int64_t>> sample = {{0, kEnds}};
  // Window i starts at kEnds + i * gap: evenly over the middle, which is
  // longer than the windows together, so they neither touch nor overlap
  // the ends.
  const int64_t middle = tokens - 2 * kEnds, gap = middle / kWindows;
  for (int64_t i = 0; i < kWindows; ++i) sample.push_back({kEnds + i * gap, kWindow});
  sample.push_back({tokens - kEnds, kEnds});
  return sample;
}

namespace {

absl::StatusOr<File> OpenFile(const std::string& path, int64_t* size) {
  PLATEAU_ASSIGN_OR_RETURN(const int fd, OpenRegularFile(path));
  File f(fd);
  off_t end = lseek(fd, 0, SEEK_END);
  if (end < 0) return FileError(absl::StrCat(path, ": cannot seek"), errno);
  *size = end;
  return f;
}

absl::StatusOr<std::unique_ptr<DataSource>> Finish(std::vector<TokenStream::Part> parts,
                                                   int64_t vocab, const DataSlice& slice,
                                                   absl::string_view what) {
  auto s = std::make_unique<TokenStream>(std::move(parts), vocab, slice);
  if (s->total() < slice.seq_len + 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        what, ": ", s->total(), " tokens in all, fewer than one sequence of seq_len + 1 = ",
        slice.seq_len + 1));
  }
  if (s->sequences() < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "data.held_out_sequences: ", slice.held_out, " sequences hold out ", slice.held_out * slice.seq_len + 1,
        " of the ", s->total(), " tokens of ", what, ", leaving fewer than one training sequence of seq_len + 1 = ",
        slice.seq_len + 1));
  }
  // Fewer training sequences than a batch: each batch would hold some of
  // them two or three times (position + b wraps within it), a weighting
  // nothing else shows (a 1,000-byte text at seq_len 64 gives 15 for a
  // batch of 32).
  if (!slice.validation && s->sequences() < slice.batch) {
    return absl::InvalidArgumentError(absl::StrCat(
        what, ": ", s->total(), " tokens make ", s->sequences(),
        " training sequences of seq_len + 1 = ", slice.seq_len + 1, " tokens",
        slice.held_out > 0 ? absl::StrCat(" (data.held_out_sequences: ", slice.held_out, " held out)") : "",
        ", fewer than layout.batch = ", slice.batch,
        ": every batch would repeat sequences; give more data or a smaller layout.batch"));
  }
  PLATEAU_RETURN_IF_ERROR(s->Fingerprint());
  return std::unique_ptr<DataSource>(std::move(s));
}

// ---------------------------------------------------------------------------

class AssociativeRecall final : public DataSource {
 public:
  AssociativeRecall(const RecallTask& t, const DataSlice& s) : task_(t), slice_(s) {}
  int64_t vocab_size() const override { return task_.vocab_size(); }
  uint64_t position() const override { return position_; }
  void Seek(uint64_t position) override { position_ = position; }

  absl::Status Next(Batch* out) override {
    const int64_t T = slice_.seq_len, n = T / slice_.ranks;
    out->tokens.resize(slice_.batch * n);
    out->targets.resize(slice_.batch * n);
    std::vector<int32_t> tok(T), tgt(T);
    for (int64_t b = 0; b < slice_.batch; ++b) {
      const uint64_t index = position_ + b;
      if (slice_.held_out == 0) {
        Generate(index, 0, tok.data(), tgt.data());
      } else {
        // Split by content: the first draw (attempt 0, 1, ...) of sequence
        // `index` whose class is this split's. A training and a held-out
        // sequence are of different classes, so never the same sequence.
        const uint64_t i = slice_.validation ? index % static_cast<uint64_t>(slice_.held_out) : index;
        PLATEAU_RETURN_IF_ERROR(DrawOfClass(i, tok.data(), tgt.data()));
      }
      std::copy_n(tok.begin() + slice_.rank * n, n, out->tokens.begin() + b * n);
      std::copy_n(tgt.begin() + slice_.rank * n, n, out->targets.begin() + b * n);
    }
    position_ += slice_.batch;
    return absl::OkStatus();
  }

  // The first draw of sequence `index` whose class is this split's (1: the
  // held-out split, 0: training). A hash bit is one of two classes with
  // probability 1/2 per draw, so kMaxDraws misses happen with probability
  // 2^-kMaxDraws unless the task has too few distinct sequences to have both
  // classes (e.g. one key and one value): then an error, never a spin.
  absl::Status DrawOfClass(uint64_t index, int32_t* tok, int32_t* tgt) const {
    constexpr uint64_t kMaxDraws = 256;
    const uint64_t want = slice_.validation ? 1 : 0;
    for (uint64_t attempt = 0; attempt < kMaxDraws; ++attempt) {
      Generate(index, attempt, tok, tgt);
      if (ClassOf(tok, slice_.seq_len) == want) return absl::OkStatus();
    }
    return absl::InvalidArgumentError(
        absl::StrCat("data.held_out_sequences: the recall task (num_keys ", task_.num_keys, ", num_values ",
                     task_.num_values, ", pairs ", task_.pairs, ") has too few distinct sequences to split: no ",
                     slice_.validation ? "held-out" : "training", " sequence in ", kMaxDraws,
                     " draws; expected more keys or values, or held_out_sequences 0"));
  }

  // The split a sequence belongs to when there is one: a bit of a hash of
  // its tokens (the targets follow from them).
  static uint64_t ClassOf(const int32_t* tok, int64_t T) { return HashTokens(0x243f6a8885a308d3ULL, tok, T) & 1; }

  // Sequence `index` (draw `attempt`), a pure function of (seed, index,
  // attempt); attempt 0 is the sequence the task had before splits existed.
  void Generate(uint64_t index, uint64_t attempt, int32_t* tok, int32_t* tgt) const {
    const int64_t T = slice_.seq_len;
    uint64_t counter = Mix64(task_.seed) ^ Mix64(index * 0x9e3779b97f4a7c15ULL + 1);
    if (attempt > 0) counter ^= Mix64(attempt * 0xd1b54a32d192ed03ULL + 7);
    auto next = [&counter](uint64_t bound) { return Mix64(counter++) % bound; };
    std::fill(tok, tok + T, 0);
    std::fill(tgt, tgt + T, kIgnoreIndex);
    std::vector<int32_t> keys(task_.num_keys);
    std::iota(keys.begin(), keys.end(), 2);
    for (int64_t j = 0; j < task_.pairs; ++j) {  // partial Fisher-Yates
      std::swap(keys[j], keys[j + next(task_.num_keys - j)]);
    }
    std::vector<int32_t> values(task_.pairs);
    for (auto& v : values) v = static_cast<int32_t>(2 + task_.num_keys + next(task_.num_values));
    // Pairs spread evenly over the context before the queries, so the
    // queries reach back across the whole sequence (and across ranks).
    const int64_t region = T - 3 * task_.queries;
    for (int64_t j = 0; j < task_.pairs; ++j) {
      const int64_t at = j * (region / task_.pairs);
      tok[at] = keys[j];
      tok[at + 1] = values[j];
    }
    std::vector<int64_t> asked(task_.pairs);
    std::iota(asked.begin(), asked.end(), 0);
    for (int64_t q = 0; q < task_.queries; ++q) {
      std::swap(asked[q], asked[q + next(task_.pairs - q)]);
      const int64_t at = region + 3 * q;
      tok[at] = 1;  // QUERY
      tok[at + 1] = keys[asked[q]];
      tok[at + 2] = values[asked[q]];
      tgt[at + 1] = values[asked[q]];  // the answer is predicted at the key
    }
  }

 private:
  RecallTask task_;
  DataSlice slice_;
  uint64_t position_ = 0;
};

}  // namespace

absl::StatusOr<std::unique_ptr<DataSource>> OpenTokenShards(
    std::vector<std::string> paths, int64_t vocab_size, const DataSlice& slice) {
  PLATEAU_RETURN_IF_ERROR(CheckSlice(slice));
  if (paths.empty()) return absl::InvalidArgumentError("data.shards: expected at least one file");
  if (vocab_size < 2) return absl::InvalidArgumentError("data: vocab_size must be >= 2");
  std::vector<TokenStream::Part> parts;
  for (const std::string& path : paths) {
    int64_t size = 0;
    PLATEAU_ASSIGN_OR_RETURN(File f, OpenFile(path, &size));
    int32_t header[kShardHeaderInts];
    if (size < static_cast<int64_t>(sizeof(header))) {
      return absl::InvalidArgumentError(absl::StrCat(path, ": ", size, " bytes, shorter than the 1024-byte shard header"));
    }
    PLATEAU_RETURN_IF_ERROR(ReadAt(f.fd(), path, header, sizeof(header), 0));
    if (header[0] != kShardMagic) {
      return absl::InvalidArgumentError(absl::StrCat(path, ": bad magic ", header[0], ", expected ", kShardMagic, " (an llm.c token shard)"));
    }
    if (header[1] != 1 && header[1] != 2) {
      return absl::InvalidArgumentError(absl::StrCat(path, ": unsupported version ", header[1], ", expected 1 (uint16) or 2 (uint32)"));
    }
    const int64_t tb = header[1] == 1 ? 2 : 4, count = header[2];
    if (count < 0 || static_cast<int64_t>(sizeof(header)) + count * tb != size) {
      return absl::InvalidArgumentError(absl::StrCat(path, ": header says ", count, " tokens of ", tb,
                                                     " bytes but the file has ", size - static_cast<int64_t>(sizeof(header)), " bytes of tokens"));
    }
    parts.push_back({path, std::move(f), static_cast<int64_t>(sizeof(header)), tb, count});
  }
  return Finish(std::move(parts), vocab_size, slice, "data.shards");
}

absl::StatusOr<std::unique_ptr<DataSource>> OpenByteText(const std::string& path,
                                                         const DataSlice& slice) {
  PLATEAU_RETURN_IF_ERROR(CheckSlice(slice));
  int64_t size = 0;
  PLATEAU_ASSIGN_OR_RETURN(File f, OpenFile(path, &size));
  std::vector<TokenStream::Part> parts;
  parts.push_back({path, std::move(f), 0, 1, size});
  return Finish(std::move(parts), 256, slice, "data.text");
}

absl::StatusOr<std::unique_ptr<DataSource>> OpenAssociativeRecall(const RecallTask& t,
                                                                  const DataSlice& slice) {
  PLATEAU_RETURN_IF_ERROR(CheckSlice(slice));
  if (t.num_keys < 1 || t.num_values < 1) {
    return absl::InvalidArgumentError("data.recall: num_keys and num_values must be >= 1");
  }
  if (t.pairs < 1 || t.pairs > t.num_keys) {
    return absl::InvalidArgumentError(absl::StrCat("data.recall.pairs: expected 1 to num_keys = ", t.num_keys, ", got ", t.pairs));
  }
  if (t.queries < 1 || t.queries > t.pairs) {
    return absl::InvalidArgumentError(absl::StrCat("data.recall.queries: expected 1 to pairs = ", t.pairs, ", got ", t.queries));
  }
  const int64_t region = slice.seq_len - 3 * t.queries;
  if (region < 2 * t.pairs) {
    return absl::InvalidArgumentError(absl::StrCat(
        "data.seq_len: ", slice.seq_len, " is too short for ", t.pairs, " pairs and ", t.queries,
        " queries; expected >= ", 2 * t.pairs + 3 * t.queries));
  }
  auto source = std::make_unique<AssociativeRecall>(t, slice);
  if (slice.held_out > 0) {
    // A task too small to split fails here, at the rank's start, rather
    // than at its first batch.
    std::vector<int32_t> tok(slice.seq_len), tgt(slice.seq_len);
    PLATEAU_RETURN_IF_ERROR(source->DrawOfClass(0, tok.data(), tgt.data()));
  }
  return std::unique_ptr<DataSource>(std::move(source));
}

absl::Status WriteTokenShard(const std::string& path, const std::vector<int32_t>& tokens) {
  int32_t header[kShardHeaderInts] = {};
  header[0] = kShardMagic;
  header[1] = 1;
  header[2] = static_cast<int32_t>(tokens.size());
  std::vector<uint16_t> body(tokens.size());
  for (size_t i = 0; i < tokens.size(); ++i) {
    if (tokens[i] < 0 || tokens[i] > 65535) {
      return absl::InvalidArgumentError(absl::StrCat("token ", tokens[i], " at ", i, " does not fit uint16"));
    }
    body[i] = static_cast<uint16_t>(tokens[i]);
  }
  FILE* f = std::fopen(path.c_str(), "wb");
  if (f == nullptr) return absl::InternalError(absl::StrCat(path, ": cannot create"));
  bool ok = std::fwrite(header, sizeof(header), 1, f) == 1 &&
            (body.empty() || std::fwrite(body.data(), 2, body.size(), f) == body.size());
  ok = (std::fclose(f) == 0) && ok;
  if (!ok) return absl::InternalError(absl::StrCat(path, ": write failed"));
  return absl::OkStatus();
}

}  // namespace plateau
