#include "worker/trainer.h"

#include <errno.h>
#include <signal.h>

#include <charconv>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <map>
#include <optional>
#include <set>
#include <utility>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "kernels/optimizer/lr_schedule.h"
#include "kernels/status_macros.h"
#include "proto/utf8.h"
#include "worker/checkpoint_fence.h"
#include "worker/file_errors.h"
#include "worker/safetensors.h"

namespace plateau {
namespace {

// The spec's field that names the job's data files, for errors about them.
std::string DataField(const TrainerOptions& o) {
  switch (o.data.kind) {
    case DataOptions::Kind::kText:
      return "data.text.path";
    case DataOptions::Kind::kShards:
      return "data.shards.paths";
    case DataOptions::Kind::kRecall:
      break;
  }
  return "data.recall";
}

// DataSource::stream_fingerprint as the checkpoint metadata stores it: 16
// hex digits.
std::string FingerprintText(const DataSource& data) {
  return absl::StrCat(absl::Hex(data.stream_fingerprint(), absl::kZeroPad16));
}

// The shortest text that reads back as `x`'s bits ("1e-05", not
// "9.99999975e-06"; "500000", not "5e+05"): std::to_chars, %g's style.
std::string FloatText(float x) {
  char buf[32];
  const std::to_chars_result r = std::to_chars(buf, buf + sizeof(buf), x, std::chars_format::general);
  return std::string(buf, r.ptr);
}

// What a checkpoint's state means, beyond its tensors' shapes: the model
// fields that change the function with the same shapes (heads and kv_heads
// scaled together, top_k, rope_theta, norm_eps) or the tensors' count
// (layers), and what its data position counts (sequences of seq_len tokens
// of the training stream, which the held-out split shortens). Stored in
// the metadata under the job spec's own field names, and compared on
// resume, so a mismatch is refused naming the field.
std::vector<std::pair<std::string, std::string>> CheckpointIdentity(const TrainerOptions& o) {
  const ModelConfig& m = o.step.model;
  std::vector<std::pair<std::string, std::string>> out = {
      {"model.vocab_size", absl::StrCat(m.vocab_size)}, {"model.hidden", absl::StrCat(m.hidden)},
      {"model.layers", absl::StrCat(m.layers)},         {"model.heads", absl::StrCat(m.heads)},
      {"model.kv_heads", absl::StrCat(m.kv_heads)},     {"model.experts", absl::StrCat(m.experts)},
      {"model.top_k", absl::StrCat(m.top_k)},           {"model.expert_ffn", absl::StrCat(m.expert_ffn)},
      {"model.seq_len", absl::StrCat(m.seq_len)},       {"model.rope_theta", FloatText(m.rope_theta)},
      {"model.norm_eps", FloatText(m.norm_eps)},        {"data.held_out_sequences", absl::StrCat(o.data.held_out)}};
  // The recall task's shape is its stream as much as its seed: other
  // pairs (the same vocabulary) would be another task at the same position.
  if (o.data.kind == DataOptions::Kind::kRecall) {
    const RecallTask& r = o.data.recall;
    out.insert(out.end(), {{"data.recall.num_keys", absl::StrCat(r.num_keys)},
                           {"data.recall.num_values", absl::StrCat(r.num_values)},
                           {"data.recall.pairs", absl::StrCat(r.pairs)},
                           {"data.recall.queries", absl::StrCat(r.queries)}});
  }
  return out;
}

// The learning-rate schedule, under the job spec's field names: a resume
// under another one runs its next step at another rate (steps 100 -> 200
// under a cosine decay: from 6.0e-4 back up to 3.5e-3). The job's steps
// shape the rate only under a decay ("-" otherwise).
std::vector<std::pair<std::string, std::string>> ScheduleIdentity(const OptimizerConfig& o) {
  const LrSchedule& s = o.schedule;
  return {{"optimizer.lr", FloatText(o.lr)},
          {"optimizer.lr_decay", std::string(LrDecayName(s.decay))},
          {"optimizer.warmup_steps", absl::StrCat(s.warmup_steps)},
          {"optimizer.min_lr", absl::StrFormat("%.17g", s.min_lr)},
          {"steps", s.decay == LrSchedule::Decay::kConstant ? "-" : absl::StrCat(s.total_steps)}};
}

// The schedule a checkpoint's metadata names (ScheduleIdentity's keys);
// nullopt when it lacks one or one does not parse (an older file).
std::optional<OptimizerConfig> ScheduleOf(const std::map<std::string, std::string>& metadata,
                                          const OptimizerConfig& mine) {
  OptimizerConfig o = mine;
  const auto get = [&](const char* key) -> const std::string* {
    auto it = metadata.find(key);
    return it == metadata.end() ? nullptr : &it->second;
  };
  const std::string *lr = get("optimizer.lr"), *decay = get("optimizer.lr_decay"),
                    *warmup = get("optimizer.warmup_steps"), *min_lr = get("optimizer.min_lr"), *steps = get("steps");
  if (!lr || !decay || !warmup || !min_lr || !steps) return std::nullopt;
  double lr_value = 0;
  if (!absl::SimpleAtod(*lr, &lr_value) || !absl::SimpleAtoi(*warmup, &o.schedule.warmup_steps) ||
      !absl::SimpleAtod(*min_lr, &o.schedule.min_lr)) {
    return std::nullopt;
  }
  o.lr = static_cast<float>(lr_value);
  bool known = false;
  for (LrSchedule::Decay d : {LrSchedule::Decay::kConstant, LrSchedule::Decay::kCosine, LrSchedule::Decay::kLinear}) {
    if (*decay == LrDecayName(d)) {
      o.schedule.decay = d;
      known = true;
    }
  }
  if (!known) return std::nullopt;
  if (*steps != "-" && !absl::SimpleAtoi(*steps, &o.schedule.total_steps)) return std::nullopt;
  return o;
}

constexpr char kCheckpointFormat[] = "plateau-checkpoint-v1";

absl::StatusOr<std::unique_ptr<DataSource>> OpenData(const TrainerOptions& o, int rank, bool validation = false) {
  const ModelConfig& m = o.step.model;
  DataSlice slice{o.step.layout.batch, m.seq_len, rank, o.step.layout.ranks, o.data.held_out, validation};
  std::unique_ptr<DataSource> src;
  switch (o.data.kind) {
    case DataOptions::Kind::kRecall: {
      PLATEAU_ASSIGN_OR_RETURN(src, OpenAssociativeRecall(o.data.recall, slice));
      break;
    }
    case DataOptions::Kind::kShards: {
      PLATEAU_ASSIGN_OR_RETURN(src, OpenTokenShards(o.data.paths, m.vocab_size, slice));
      break;
    }
    case DataOptions::Kind::kText: {
      if (o.data.paths.size() != 1) {
        return absl::InvalidArgumentError("data.text: expected exactly one file");
      }
      PLATEAU_ASSIGN_OR_RETURN(src, OpenByteText(o.data.paths[0], slice));
      break;
    }
  }
  if (src->vocab_size() > m.vocab_size) {
    return absl::InvalidArgumentError(absl::StrCat("model.vocab_size: the data has ",
                                                   src->vocab_size(), " tokens, the model only ",
                                                   m.vocab_size));
  }
  return src;
}

// The file's tensors, in the documented order: each weight's master, m, v
// (docs/MODEL.md, "Checkpoints"); weight w's family f is tensor 3w + f.
std::vector<TensorSpec> CheckpointTensors(const ParamLayout& layout) {
  std::vector<TensorSpec> specs;
  for (const WeightSpec& w : layout.weights()) {
    for (const char* prefix : {"", "optimizer.m.", "optimizer.v."}) specs.push_back({prefix + w.name, w.shape});
  }
  return specs;
}

size_t CheckpointTensor(int weight, StateFamily family) {
  return 3 * static_cast<size_t>(weight) + static_cast<size_t>(family);
}

// Rank 0, after the checkpoint of `step` is in place: removes what
// checkpoint.keep_last no longer keeps and says what was written and
// removed (the job's log: a directory that grows by a checkpoint's bytes
// at every save must not do so silently).
//
// Only now may an older checkpoint go: SafetensorsWriter::Commit and
// CommitCheckpoint have fsynced the file and renamed it durably, so a crash
// at any point leaves a whole checkpoint to resume from (at worst an extra
// older one, which the next save removes). None is being read: every rank
// loaded the one it resumed from before the first step, and this
// checkpoint's gathers wait for every rank. A fenced attempt that a newer
// one has replaced does not get here (its commit is refused); one replaced
// since its commit removes only steps before its own, and the newer
// attempt resumes from this step or a later one.
//
// Retention failing fails nothing: the checkpoint is safe, and a file left
// behind costs disk, which the line says.
void RetainCheckpoints(const TrainerOptions& o, const std::string& path, int64_t step) {
  std::error_code ec;
  const uintmax_t bytes = std::filesystem::file_size(path, ec);
  std::string line = absl::StrCat("checkpoint: wrote ", path, " (step ", step, " of ", o.steps, ", ",
                                  ec ? std::string("size unknown") : absl::StrCat(bytes, " bytes"), ")");
  const absl::StatusOr<CheckpointRetention> r = RemoveOldCheckpoints(o.checkpoint_dir, step, o.checkpoint_keep_last);
  if (!r.ok()) {
    absl::StrAppend(&line, "; old checkpoints not removed: ", r.status().message());
  } else {
    if (!r->removed.empty()) absl::StrAppend(&line, "; removed ", absl::StrJoin(r->removed, ", "));
    if (!r->failed.empty()) absl::StrAppend(&line, "; could not remove ", absl::StrJoin(r->failed, ", "));
    absl::StrAppend(&line, "; keeping ", o.checkpoint_keep_last == 0 ? "all " : "", r->kept.size(), " checkpoint(s), ",
                    r->kept_bytes, " bytes (checkpoint.keep_last = ", o.checkpoint_keep_last, ")");
  }
  if (o.say) o.say(line);
}

absl::Status SaveCheckpoint(const TrainerOptions& o, TrainingStep& step, const DataSource& data,
                            int rank) {
  // Written aside, then renamed into place only if no newer attempt has
  // claimed the directory meanwhile (worker/checkpoint_fence.h).
  const std::string final_path = CheckpointPath(o.checkpoint_dir, step.step());
  const std::string path = o.fence_attempt < 0
                               ? final_path
                               : PartialCheckpointPath(o.checkpoint_dir, o.fence_job, o.fence_attempt, step.step());
  // docs/MODEL.md, "Checkpoints": "seed" is the initialisation's; the
  // recall task's generator has a seed of its own (text and shards have none).
  std::map<std::string, std::string> metadata = {{"step", absl::StrCat(step.step())},
                                                 {"data_position", absl::StrCat(data.position())},
                                                 {"data_tokens", absl::StrCat(data.stream_tokens())},
                                                 {"data_fingerprint", FingerprintText(data)},
                                                 {"seed", absl::StrCat(o.step.seed)},
                                                 {"format", kCheckpointFormat}};
  for (auto& [key, value] : CheckpointIdentity(o)) metadata[key] = std::move(value);
  for (auto& [key, value] : ScheduleIdentity(o.step.optimizer)) metadata[key] = std::move(value);
  if (o.data.kind == DataOptions::Kind::kRecall) {
    metadata["data_seed"] = absl::StrCat(o.data.recall.seed);
  }
  absl::Status made;  // rank 0's; it still takes part in the gathers, which the others wait on
  if (rank == 0) {
    std::error_code ec;
    std::filesystem::create_directories(o.checkpoint_dir, ec);
    if (ec) made = CheckpointDirectoryError(o.checkpoint_dir, "create it", ec.value());
  }
  PLATEAU_RETURN_IF_ERROR(WriteCheckpointFile(step, path, metadata, /*writer=*/rank == 0 && made.ok()));
  if (rank != 0) return absl::OkStatus();
  PLATEAU_RETURN_IF_ERROR(made);
  if (o.fence_attempt >= 0) {
    PLATEAU_RETURN_IF_ERROR(CommitCheckpoint(o.checkpoint_dir, o.fence_job, o.fence_attempt, path, final_path));
  }
  RetainCheckpoints(o, final_path, step.step());
  return absl::OkStatus();
}

// Loads step `step_in_name`'s checkpoint (its file name's number).
absl::Status LoadCheckpoint(const TrainerOptions& o, const std::string& path, int64_t step_in_name, TrainingStep& step,
                            DataSource& data) {
  uint64_t position = 0;
  PLATEAU_RETURN_IF_ERROR(
      ReadCheckpointFile(path, step, [&](std::map<std::string, std::string> metadata) -> absl::StatusOr<int64_t> {
        // A later format is another reader's (a file without the key is
        // not ours either).
        if (metadata["format"] != kCheckpointFormat) {
          return absl::FailedPreconditionError(absl::StrCat(path, ": metadata format is '",
                                                            Utf8Prefix(metadata["format"], 40), "', expected '",
                                                            kCheckpointFormat, "'"));
        }
        int64_t step_count = 0;
        if (!absl::SimpleAtoi(metadata["step"], &step_count) ||
            !absl::SimpleAtoi(metadata["data_position"], &position)) {
          return absl::DataLossError(absl::StrCat(path, ": metadata lacks step or data_position"));
        }
        // The file's name chose it (the newest, and not past the job's
        // end); a step that disagrees would resume at another point.
        if (step_count != step_in_name) {
          return absl::DataLossError(
              absl::StrCat(path, ": metadata step is ", step_count, ", but the file's name says step ", step_in_name));
        }
        for (const auto& [key, mine] : CheckpointIdentity(o)) {
          // A checkpoint without the keys predates them and is not checked.
          auto it = metadata.find(key);
          if (it == metadata.end() || it->second == mine) continue;
          return absl::FailedPreconditionError(
              absl::StrCat(key, ": the job says ", mine, ", but its checkpoint ", path, " was trained with ",
                           Utf8Prefix(it->second, 40),
                           "; resume with the checkpoint's value, or start the new job in another checkpoint_dir"));
        }
        // The schedule: refused where it differs (the next step's rate
        // would jump), or taken and said with both rates when the job asks.
        // A checkpoint without the keys predates them and is not checked.
        for (const auto& [key, mine] : ScheduleIdentity(o.step.optimizer)) {
          auto it = metadata.find(key);
          if (it == metadata.end() || it->second == mine) continue;
          const int64_t next = step_count + 1;
          const std::optional<OptimizerConfig> theirs = ScheduleOf(metadata, o.step.optimizer);
          // A field that no longer shapes the rate (a warm-up both runs are
          // past, min_lr under a constant schedule): the same rates at the
          // next step and at the job's last, nothing to refuse.
          if (theirs && LearningRate(*theirs, next) == LearningRate(o.step.optimizer, next) &&
              LearningRate(*theirs, o.steps) == LearningRate(o.step.optimizer, o.steps)) {
            continue;
          }
          const std::string rates = theirs
                                        ? absl::StrFormat(
                                              "its step %d runs at lr %.4g under the checkpoint's schedule, %.4g under "
                                              "this job's",
                                              next, LearningRate(*theirs, next), LearningRate(o.step.optimizer, next))
                                        : "the checkpoint's schedule is incomplete";
          const std::string what = absl::StrCat(key, ": the job says ", Utf8Prefix(mine, 40), ", but its checkpoint ",
                                                path, " was trained under ", Utf8Prefix(it->second, 40));
          if (!o.reschedule_on_resume) {
            return absl::FailedPreconditionError(
                absl::StrCat(what, " (", rates,
                             "); resume with the checkpoint's schedule, set "
                             "optimizer.reschedule_on_resume to take this one, or start in another checkpoint_dir"));
          }
          if (o.say) o.say(absl::StrCat("optimizer.reschedule_on_resume: ", what, "; ", rates));
          break;  // said once, with the rates
        }
        // The data position counts sequences of the stream the checkpoint
        // was trained on; another recall seed is another stream, and the
        // resumed run would silently be neither the old run nor a new one.
        if (o.data.kind == DataOptions::Kind::kRecall && metadata.count("data_seed") > 0 &&
            metadata["data_seed"] != absl::StrCat(o.data.recall.seed)) {
          return absl::FailedPreconditionError(
              absl::StrCat("data.recall.seed: the job says ", o.data.recall.seed, ", but its checkpoint ", path,
                           " was trained on data seed ", Utf8Prefix(metadata["data_seed"], 40),
                           "; resume with the checkpoint's seed, or start the new seed in another checkpoint_dir"));
        }
        // The same for files: a position in a stream of another length
        // points elsewhere (a checkpoint without the key predates it).
        if (metadata.count("data_tokens") > 0 && metadata["data_tokens"] != absl::StrCat(data.stream_tokens())) {
          return absl::FailedPreconditionError(absl::StrCat(
              DataField(o), ": this job's files hold ", data.stream_tokens(), " tokens, but its checkpoint ", path,
              " was trained on a stream of ", Utf8Prefix(metadata["data_tokens"], 40),
              "; resume on the same data, or start the new data in another checkpoint_dir"));
        }
        // Of the same length but other contents (another file of the same
        // size, shards in another order): its sample hashes otherwise.
        if (metadata.count("data_fingerprint") > 0 && metadata["data_fingerprint"] != FingerprintText(data)) {
          return absl::FailedPreconditionError(
              absl::StrCat(DataField(o), ": this job's files (", data.stream_tokens(), " tokens, fingerprint ",
                           FingerprintText(data), ") are not the stream its checkpoint ", path,
                           " was trained on (fingerprint ", Utf8Prefix(metadata["data_fingerprint"], 40),
                           "); resume on the same data, or start the new data in another checkpoint_dir"));
        }
        return step_count;
      }));
  data.Seek(position);
  return absl::OkStatus();
}

// The validation loss: every held-out sequence once, in batches of the
// step's, forward only. The mean token cross-entropy over all of them:
// sum_b loss_b * valid_b / sum_b valid_b (each batch's loss is its sum over
// its valid targets divided by their count, the same on any rank count).
// Its peaks are folded into the step's, so the reported peaks cover it.
absl::Status Validate(const TrainerOptions& o, TrainingStep& step, DataSource& held_out, StepReport* r) {
  held_out.Seek(0);
  double sum = 0;
  int64_t valid = 0;
  Batch batch;
  for (int64_t b = 0; b < o.data.held_out / o.step.layout.batch; ++b) {
    PLATEAU_RETURN_IF_ERROR(held_out.Next(&batch));
    PLATEAU_ASSIGN_OR_RETURN(StepStats e, step.Evaluate(batch.tokens, batch.targets));
    sum += e.loss * static_cast<double>(e.valid_tokens);
    valid += e.valid_tokens;
    r->stats.device.KeepPeaks(e.device);
    r->stats.host.KeepPeaks(e.host);
  }
  r->has_validation = true;
  r->validation_loss = valid > 0 ? sum / static_cast<double>(valid) : 0.0;
  return absl::OkStatus();
}

}  // namespace

// Streamed (TrainingStep::StreamState): every rank gathers, the writer
// alone writes the pieces into place in the file, and no host holds the
// full state (at a real model's size it would not fit).
absl::Status WriteCheckpointFile(TrainingStep& step, const std::string& path,
                                 const std::map<std::string, std::string>& metadata, bool writer) {
  std::unique_ptr<SafetensorsWriter> file;
  absl::Status opened;  // the writer's: it still takes part in the gathers, which the others wait on
  if (writer) {
    absl::StatusOr<std::unique_ptr<SafetensorsWriter>> w =
        SafetensorsWriter::Create(path, CheckpointTensors(step.layout()), metadata);
    if (w.ok()) {
      file = std::move(*w);
    } else {
      opened = w.status();
    }
  }
  const StateSink sink = [&file](StateFamily family, int weight, int64_t offset, const float* values, int64_t n) {
    return file->Write(CheckpointTensor(weight, family), offset, values, n);
  };
  PLATEAU_RETURN_IF_ERROR(step.StreamState(file != nullptr ? &sink : nullptr));  // collective
  PLATEAU_RETURN_IF_ERROR(opened);
  return file != nullptr ? file->Commit() : absl::OkStatus();
}

// Streamed (TrainingStep::LoadStreamedState): each rank reads its own
// shard's values from the file, and no more.
absl::Status ReadCheckpointFile(
    const std::string& path, TrainingStep& step,
    const std::function<absl::StatusOr<int64_t>(std::map<std::string, std::string>)>& accept) {
  PLATEAU_ASSIGN_OR_RETURN(std::unique_ptr<SafetensorsReader> f, SafetensorsReader::Open(path));
  // The metadata first: it names the field a checkpoint of another model
  // differs in, where the tensors below can only say which tensor.
  PLATEAU_ASSIGN_OR_RETURN(const int64_t step_count, accept(f->metadata()));
  const std::vector<TensorSpec> specs = CheckpointTensors(step.layout());
  std::set<std::string> names;
  for (const TensorSpec& t : specs) {
    names.insert(t.name);
    auto it = f->tensors().find(t.name);
    if (it == f->tensors().end() || it->second.shape != t.shape) {
      return absl::DataLossError(absl::StrCat(path, ": tensor '", t.name,
                                              "' is missing or has the wrong shape for this model"));
    }
  }
  // More tensors than this model has: another model's (a deeper one),
  // whose first layers would otherwise load as this one.
  for (const auto& [name, tensor] : f->tensors()) {
    if (names.count(name) == 0) {
      return absl::FailedPreconditionError(
          absl::StrCat(path, ": holds tensor '", Utf8Prefix(name, 200), "', which this model (model.layers = ",
                       step.layout().model().layers, ") lacks: a checkpoint of another model"));
    }
  }
  return step.LoadStreamedState(step_count,
                                [&](StateFamily family, int weight, int64_t offset, float* values, int64_t n) {
                                  return f->Read(specs[CheckpointTensor(weight, family)].name, offset, values, n);
                                });
}

std::string CheckpointPath(const std::string& dir, int64_t step) {
  return absl::StrFormat("%s/step-%08d.safetensors", dir, step);
}

namespace {

// The step of a file named as CheckpointPath names it, or -1. Only those
// names: SimpleAtoi also takes "step-42" or "step-+42", whose step would
// then be loaded from (or retention would count) "step-00000042", a file
// that may not exist.
int64_t CheckpointStepOfName(const std::string& name) {
  int64_t step = 0;
  if (name.size() > 17 && name.rfind("step-", 0) == 0 && name.compare(name.size() - 12, 12, ".safetensors") == 0 &&
      absl::SimpleAtoi(name.substr(5, name.size() - 17), &step) && step >= 0 &&
      name == std::filesystem::path(CheckpointPath("", step)).filename().string()) {
    return step;
  }
  return -1;
}

}  // namespace

// The newest "step-N.safetensors" in dir, or -1 when there is none (a
// directory not made yet counts as empty). A directory that cannot be read
// is an error, never "none": a rank that started afresh beside ranks that
// resumed would train on a mixed state.
absl::StatusOr<int64_t> NewestCheckpoint(const std::string& dir) {
  int64_t best = -1;
  std::error_code ec;
  std::filesystem::directory_iterator it(dir, ec);
  // Missing, or a path through a file: nothing to resume (rank 0 says
  // why when it cannot create it at the first checkpoint).
  if (ec == std::errc::no_such_file_or_directory || ec == std::errc::not_a_directory) return best;
  for (; !ec && it != std::filesystem::directory_iterator(); it.increment(ec)) {
    best = std::max(best, CheckpointStepOfName(it->path().filename().string()));
  }
  if (ec) return FileError(absl::StrCat("checkpoint.directory=", dir, ": cannot list it to resume"), ec.value());
  return best;
}

absl::StatusOr<CheckpointRetention> RemoveOldCheckpoints(const std::string& dir, int64_t newest, int64_t keep_last) {
  // step -> size (-1: unknown), newest first.
  std::map<int64_t, int64_t, std::greater<int64_t>> found;
  std::error_code ec;
  std::filesystem::directory_iterator it(dir, ec);
  for (; !ec && it != std::filesystem::directory_iterator(); it.increment(ec)) {
    const int64_t step = CheckpointStepOfName(it->path().filename().string());
    if (step < 0 || step > newest) continue;
    std::error_code size_ec;
    const uintmax_t size = it->file_size(size_ec);
    found[step] = size_ec ? -1 : static_cast<int64_t>(size);
  }
  if (ec) return FileError(absl::StrCat("checkpoint.directory=", dir, ": cannot list it"), ec.value());
  CheckpointRetention r;
  for (const auto& [step, size] : found) {
    // `newest` is never removed, whatever keep_last says: it is the one a
    // restart resumes from.
    if (keep_last == 0 || step == newest || static_cast<int64_t>(r.kept.size()) < keep_last) {
      r.kept.push_back(step);
      r.kept_bytes += std::max<int64_t>(size, 0);
      continue;
    }
    const std::string path = CheckpointPath(dir, step);
    const std::string name = std::filesystem::path(path).filename().string();
    std::error_code rm;
    if (std::filesystem::remove(path, rm)) {
      r.removed.push_back(name);
    } else if (rm) {
      r.failed.push_back(absl::StrCat(name, ": ", rm.message()));
    }
  }
  return r;
}

absl::StatusOr<std::vector<std::string>> RemoveAbandonedCheckpointFiles(const std::string& dir) {
  std::vector<std::string> removed;
  std::error_code ec;
  std::filesystem::directory_iterator it(dir, ec);
  if (ec == std::errc::no_such_file_or_directory || ec == std::errc::not_a_directory) return removed;
  for (; !ec && it != std::filesystem::directory_iterator(); it.increment(ec)) {
    const std::string name = it->path().filename().string();
    // SafetensorsWriter's temporary: the checkpoint's name, ".tmp.", the
    // writer's pid (worker/safetensors.cc).
    const size_t tmp = name.rfind(".safetensors.tmp.");
    int pid = 0;
    if (tmp == std::string::npos || name.rfind("step-", 0) != 0 || !absl::SimpleAtoi(name.substr(tmp + 17), &pid) ||
        pid <= 0) {
      continue;
    }
    // kill(pid, 0) fails with ESRCH only where no such process exists; a
    // live writer (EPERM: another user's) keeps its file.
    if (kill(pid, 0) == 0 || errno != ESRCH) continue;
    std::error_code rm;
    if (std::filesystem::remove(it->path(), rm)) removed.push_back(name);
  }
  if (ec) return FileError(absl::StrCat("checkpoint.directory=", dir, ": cannot list it"), ec.value());
  return removed;
}

absl::Status RunTraining(const TrainerOptions& o, Backend& backend, Communicator& world,
                         const std::function<void(const StepReport&)>& on_step) {
  if (o.steps < 0) return absl::InvalidArgumentError("steps: expected >= 0");
  if (o.checkpoint_every < 0) return absl::InvalidArgumentError("checkpoint_every: expected >= 0");
  if (o.checkpoint_keep_last < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("checkpoint.keep_last: expected >= 0 (0: keep every checkpoint), got ", o.checkpoint_keep_last));
  }
  if (o.validation_every < 0) return absl::InvalidArgumentError("validation_every: expected >= 0");
  if (o.validation_every > 0 && (o.data.held_out < 1 || o.data.held_out % o.step.layout.batch != 0)) {
    return absl::InvalidArgumentError(absl::StrCat("data.held_out_sequences: expected a positive multiple of "
                                                   "layout.batch = ", o.step.layout.batch,
                                                   " with validation_every, got ", o.data.held_out));
  }
  PLATEAU_ASSIGN_OR_RETURN(std::unique_ptr<DataSource> data, OpenData(o, world.rank()));
  std::unique_ptr<DataSource> held_out;
  if (o.validation_every > 0) {
    PLATEAU_ASSIGN_OR_RETURN(held_out, OpenData(o, world.rank(), /*validation=*/true));
  }
  PLATEAU_ASSIGN_OR_RETURN(std::unique_ptr<TrainingStep> step,
                           TrainingStep::Create(o.step, backend, world));
  // Each rank reads its own copy of the files (on its own node). A copy of
  // another length splices the sequences at other places than the others'
  // (and moves the held-out split), and training goes on with nothing
  // failing. One collective: the ranks' streams are of one length, or every
  // rank refuses (an invalid job: the copies are the operator's to fix).
  PLATEAU_ASSIGN_OR_RETURN(const auto stream, step->RangeAcrossRanks(data->stream_tokens()));
  if (stream.first != stream.second) {
    const int64_t mine = data->stream_tokens();
    return absl::FailedPreconditionError(absl::StrCat(
        DataField(o), ": the ranks read different data: this rank's files hold ", mine, " tokens, another rank's ",
        stream.first == mine ? stream.second : stream.first, "; every node needs the same copy"));
  }
  // Copies of one length may still differ (another file of the same size,
  // shards listed in another order): their samples' hashes, compared as
  // two 32-bit halves (RangeAcrossRanks is exact below 2^53).
  const uint64_t fingerprint = data->stream_fingerprint();
  PLATEAU_ASSIGN_OR_RETURN(const auto high, step->RangeAcrossRanks(static_cast<int64_t>(fingerprint >> 32)));
  PLATEAU_ASSIGN_OR_RETURN(const auto low, step->RangeAcrossRanks(static_cast<int64_t>(fingerprint & 0xffffffffu)));
  if (high.first != high.second || low.first != low.second) {
    return absl::FailedPreconditionError(
        absl::StrCat(DataField(o), ": the ranks read different data: this rank's files and another rank's hold ",
                     data->stream_tokens(), " tokens each but differ (this rank's fingerprint ", FingerprintText(*data),
                     "); every node needs the same copy"));
  }
  // Claimed by every rank before any reads: from then on no older attempt
  // can commit, so all ranks read the same newest checkpoint.
  if (!o.checkpoint_dir.empty() && o.fence_attempt >= 0) {
    PLATEAU_RETURN_IF_ERROR(ClaimCheckpointDir(o.checkpoint_dir, o.fence_job, o.fence_attempt));
  }
  // Without the fence, rank 0 (the writer) clears what a killed run's
  // writer left: a whole checkpoint's bytes each, never read again.
  if (!o.checkpoint_dir.empty() && o.fence_attempt < 0 && world.rank() == 0) {
    PLATEAU_ASSIGN_OR_RETURN(const std::vector<std::string> removed, RemoveAbandonedCheckpointFiles(o.checkpoint_dir));
    for (const std::string& name : removed) {
      std::fprintf(stderr, "checkpoint.directory=%s: removed %s, left by a writer that is gone\n",
                   o.checkpoint_dir.c_str(), name.c_str());
    }
  }
  if (!o.checkpoint_dir.empty() && o.resume) {
    const absl::StatusOr<int64_t> listed = NewestCheckpoint(o.checkpoint_dir);
    // Each rank lists the directory itself; they must agree, or the model
    // would resume as a mix of two states with nothing failing (a file
    // system that shows one host an older listing: NFS caches directory
    // attributes). One collective; a rank that could not list takes part
    // with -2, so that no rank waits on it.
    PLATEAU_ASSIGN_OR_RETURN(const auto range, step->RangeAcrossRanks(listed.ok() ? *listed : -2));
    PLATEAU_RETURN_IF_ERROR(listed.status());
    if (range.first != range.second) {
      const auto seen = [&](int64_t n) {
        return n == -2 ? std::string("could not list it")
               : n < 0 ? std::string("found none")
                       : absl::StrCat("found step ", n);
      };
      return absl::UnavailableError(absl::StrCat(
          "checkpoint.directory=", o.checkpoint_dir, ": the ranks see different newest checkpoints (this rank ",
          seen(*listed), "; another ", seen(range.first == *listed ? range.second : range.first),
          "): a file system that shows the ranks' hosts the directory differently; not resumed"));
    }
    const int64_t newest = *listed;
    // Past the job's end it is another, longer job's: resuming would end
    // this one at once, "finished" having trained nothing.
    if (newest > o.steps) {
      return absl::FailedPreconditionError(absl::StrCat(
          "checkpoint.directory=", o.checkpoint_dir, ": its newest checkpoint, ",
          CheckpointPath(o.checkpoint_dir, newest), ", is past this job's steps (", o.steps,
          "): it belongs to a longer job; give this job a directory of its own "
          "(or steps of at least ",
          newest, ")"));
    }
    if (newest >= 0) {
      const std::string path = CheckpointPath(o.checkpoint_dir, newest);
      PLATEAU_RETURN_IF_ERROR(LoadCheckpoint(o, path, newest, *step, *data));
      if (o.say)
        o.say(absl::StrCat("resumed from ", path, " (step ", newest, " of ", o.steps, ")"));
    }
  }
  const double flops = ModelFlopsPerStep(o.step.model, o.step.layout.batch);
  Batch batch;
  MemoryTimelineRecorder timeline(backend.device().tracker(), backend.host().tracker());
  bool first_report = true;
  while (step->step() < o.steps) {
    auto t0 = std::chrono::steady_clock::now();
    PLATEAU_RETURN_IF_ERROR(data->Next(&batch));
    const bool record = RecordsMemoryTimeline(step->step() + 1, o.memory_timeline_every);
    if (record) timeline.Begin();
    PLATEAU_ASSIGN_OR_RETURN(StepStats stats,
                             step->Step(batch.tokens, batch.targets, record ? &timeline : nullptr));
    StepReport r;
    r.stats = stats;
    r.timeline = record ? &timeline : nullptr;
    r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    r.tokens = o.step.layout.batch * o.step.model.seq_len;
    r.model_flops = flops;
    r.lr = LearningRateF(o.step.optimizer, stats.step);
    if (first_report) r.kernels = step->KernelsDescribe();
    first_report = false;
    const bool last = step->step() == o.steps;
    if (held_out != nullptr && (last || step->step() % o.validation_every == 0)) {
      PLATEAU_RETURN_IF_ERROR(Validate(o, *step, *held_out, &r));
    }
    if (on_step) on_step(r);
    if (!o.checkpoint_dir.empty() &&
        (last || (o.checkpoint_every > 0 && step->step() % o.checkpoint_every == 0))) {
      PLATEAU_RETURN_IF_ERROR(SaveCheckpoint(o, *step, *data, world.rank()));
    }
  }
  return absl::OkStatus();
}

}  // namespace plateau
