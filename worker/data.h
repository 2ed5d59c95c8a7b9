// Training data: a deterministic stream of sequences, cut for one rank.
//
// Every source numbers its sequences 0, 1, 2, …; global batch j holds
// sequences j*B … j*B+B-1, and rank p of P receives the contiguous slice
// [p*T/P, (p+1)*T/P) of every one of them (docs/MODEL.md, parallel layout).
// The position saved in a checkpoint is the number of sequences consumed, so
// resuming continues the exact same stream on any number of ranks.
//
// Sources:
// - TokenShards: llm.c / nanoGPT shard files (a 256 x int32 header: magic
//   20240520, version 1 for uint16 tokens or 2 for uint32, token count; then
//   the tokens), concatenated in the order given.
// - ByteText: any file, one token per byte (vocabulary 256).
// - AssociativeRecall: a synthetic long-context task generated on the fly.
// Shard and text streams: sequence i is tokens [i*T, i*T + T] of the
// concatenated stream (T+1 tokens: the inputs and their next-token targets),
// wrapping around at the end of the stream.
#ifndef PLATEAU_WORKER_DATA_H_
#define PLATEAU_WORKER_DATA_H_

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace plateau {

struct DataSlice {
  int64_t batch = 1;     // B sequences in the global batch
  int64_t seq_len = 0;   // T
  int64_t rank = 0;      // p
  int64_t ranks = 1;     // P; seq_len % ranks == 0
  // The held-out split (docs/MODEL.md "Validation loss"): `held_out`
  // sequences that the training stream never contains, for the validation
  // loss. 0: none, and the training stream is what it was without a split.
  // A token stream (shards, text) holds out its last held_out * T + 1
  // tokens; the recall task splits its sequences into two classes by a hash
  // of their tokens, training on one and holding out the other.
  int64_t held_out = 0;
  // Read the held-out split (its sequences 0 .. held_out - 1, over and over)
  // instead of the training stream.
  bool validation = false;
};

// One rank's part of one global batch: [B, T/P] tokens and targets
// (targets may be kIgnoreIndex).
struct Batch {
  std::vector<int32_t> tokens;
  std::vector<int32_t> targets;
};

class DataSource {
 public:
  virtual ~DataSource() = default;
  virtual int64_t vocab_size() const = 0;
  // Fills `out` with this rank's slice of the next global batch.
  virtual absl::Status Next(Batch* out) = 0;
  // Sequences consumed so far; Seek restores it (from a checkpoint).
  virtual uint64_t position() const = 0;
  virtual void Seek(uint64_t position) = 0;
  // The tokens of the files it reads (the whole stream, before the
  // held-out split), or 0 for a generated source (the same on every rank
  // by its seed). Every rank of a job, and every attempt that resumes it,
  // must read the same stream: the trainer checks this number.
  virtual int64_t stream_tokens() const { return 0; }
  // A hash of a sample of that stream, or 0 for a generated source: its
  // first and last 4,096 tokens and 64 windows of 64 tokens evenly spaced
  // between (the whole stream when it is that short), by value (a uint16
  // and a uint32 shard of the same tokens agree), read once at open.
  // Copies of one length with other contents, or shards given in another
  // order, differ here; a difference outside the sample does not.
  virtual uint64_t stream_fingerprint() const { return 0; }
};

// The sample stream_fingerprint() hashes: [offset, offset + count) ranges of
// a stream of `tokens` tokens, in order, disjoint. Exposed for tests.
std::vector<std::pair<int64_t, int64_t>> FingerprintSample(int64_t tokens);

// Opens llm.c shard files. Refuses a bad header, a token id >= vocab_size,
// or a stream shorter than one sequence, naming the file.
absl::StatusOr<std::unique_ptr<DataSource>> OpenTokenShards(
    std::vector<std::string> paths, int64_t vocab_size, const DataSlice& slice);

// Opens a text file as bytes (vocabulary 256).
absl::StatusOr<std::unique_ptr<DataSource>> OpenByteText(
    const std::string& path, const DataSlice& slice);

// The synthetic associative-recall task. Each sequence lists `pairs` distinct
// (key, value) pairs spread over the whole context, then asks `queries` of
// the keys again: "QUERY key" must be answered with its value. Only the
// answers are targets, so the loss is the recall loss: a model that ignores
// the context cannot beat ln(num_values) there. Token ids: 0 filler,
// 1 QUERY, keys [2, 2+num_keys), values [2+num_keys, 2+num_keys+num_values).
struct RecallTask {
  int64_t num_keys = 16;
  int64_t num_values = 16;
  int64_t pairs = 8;     // <= num_keys
  int64_t queries = 4;   // <= pairs
  uint64_t seed = 1;     // the data seed; the weights' seed is another
  int64_t vocab_size() const { return 2 + num_keys + num_values; }
};
absl::StatusOr<std::unique_ptr<DataSource>> OpenAssociativeRecall(
    const RecallTask& task, const DataSlice& slice);

// Writes an llm.c shard (version 1, uint16 tokens); for tests and tools.
absl::Status WriteTokenShard(const std::string& path,
                             const std::vector<int32_t>& tokens);

}  // namespace plateau

#endif  // PLATEAU_WORKER_DATA_H_
