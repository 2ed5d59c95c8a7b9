// The coordinator's durable state: jobs, their events, their logs and their
// memory timelines, and the ranks' rendezvous keys in one SQLite database
// (WAL), so that a restarted coordinator finds every job, event, log line,
// timeline and key again. A job's memory timeline is the latest each rank
// reported (one row per rank, replaced).
//
// A job is stored as its serialized plateau.v1.Job; its id is "job-<seq>"
// where seq is the row's rowid (ids are never reused). Events and log lines
// carry a per-job index 0, 1, 2, ... without gaps, assigned here.
//
// Thread safety: every method may be called from any thread (one connection
// behind a mutex).
#ifndef PLATEAU_SERVER_JOB_STORE_H_
#define PLATEAU_SERVER_JOB_STORE_H_

#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "plateau/v1/job.pb.h"

struct sqlite3;

namespace plateau {

// "job-12" -> 12; INVALID_ARGUMENT naming `field` otherwise.
absl::StatusOr<int64_t> ParseJobId(const std::string& id, const char* field = "job_id");
std::string JobIdOf(int64_t seq);

// A page of ListJobs: jobs after a cursor in submission order (or before
// it, newest first), those whose state is in `states` (all when empty) and
// that `match` accepts (all when unset). `match` runs on each stored job
// the state filter lets through, so a selective predicate scans more rows:
// they are read kListScanRows at a time, and `match` runs with the store's
// lock released, so a rare label over a long history never stalls the
// coordinator's writes for the whole scan.
constexpr int64_t kListScanRows = 256;
struct JobQuery {
  int64_t cursor = 0;  // a seq; 0: from the first (the last, newest first)
  bool newest_first = false;
  int limit = 50;
  std::vector<v1::JobState> states;
  std::function<bool(const v1::Job&)> match;
  // The page's stored bytes at most (0: no bound): a page ends early, with
  // *more set, before a job that would take it over (never before its
  // first job). Rows are read only as far as the bound: a page of 1,000
  // jobs of 1 MiB specs was read whole into memory, then sent.
  int64_t max_bytes = 0;
  // When set, a row that does not parse is listed here and skipped, not
  // the page's failure (a restart recovering its live jobs fails that one
  // job and goes on).
  std::vector<int64_t>* corrupt = nullptr;
  // When set, asked before each read of rows after the first (a scan for
  // `match`), with the store's lock released: a status that is not OK ends
  // the listing with it. A scan over a long history then stops between
  // reads, not after the last.
  std::function<absl::Status()> between_reads;
};

// A DeleteJob under way, as BeginDelete recorded it: the job and who asked
// (server/security.h CallerOf; "" from inside the process).
struct UnfinishedDelete {
  std::string job_id;
  std::string caller;
};

// A rank's memory timeline (its rank inside) and the job it belongs to.
struct JobMemoryTimeline {
  std::string job_id;
  v1::MemoryTimeline timeline;
};

// One rank's report of one step (its rank, step and attempt inside) and the
// job it belongs to: the per-rank detail behind a job's step events.
struct JobRankStep {
  std::string job_id;
  v1::StepTelemetry telemetry;
};

class JobStore {
 public:
  // How far a write survives. kPowerLoss: what a reply acknowledges (a
  // submit and its id, a state change, a rank's recorded exit, a delete)
  // survives a power loss or an OS crash: one fsync of the WAL per commit.
  // kProcessCrash: telemetry, logs, progress, rendezvous keys and sweeps,
  // many a second, survive a crash of the coordinator (the OS has the WAL)
  // but a power loss may lose their last seconds.
  enum class Durability { kProcessCrash, kPowerLoss };

  // The size the write-ahead log is cut back to once a checkpoint has
  // emptied it (PRAGMA journal_size_limit): normal traffic keeps it near
  // SQLite's 1,000-page autocheckpoint (4 MiB); one large transaction
  // would otherwise leave it at its own size on disk for good.
  static constexpr int64_t kWalSizeLimitBytes = 16 << 20;

  // Opens (creating when missing) the database at `path`.
  static absl::StatusOr<std::unique_ptr<JobStore>> Open(const std::string& path);
  ~JobStore();
  JobStore(const JobStore&) = delete;
  JobStore& operator=(const JobStore&) = delete;

  // Stores a new job and returns it with its id set. A non-empty
  // job.request_id() is recorded with it in the same transaction (one job
  // per request id: a second one is ALREADY_EXISTS naming the first).
  // `first_event`, when given, is stored as the job's event 0 (its job id
  // and index set here) in that transaction too: a submitted job never
  // exists without its submission, whatever fails or is killed between.
  absl::StatusOr<v1::Job> CreateJob(v1::Job job, v1::JobEvent* first_event = nullptr);
  // The id of the job created with `request_id`, if any.
  absl::StatusOr<std::optional<std::string>> FindRequest(const std::string& request_id);
  // Replaces the stored job of the same id.
  absl::Status PutJob(const v1::Job& job, Durability durability = Durability::kProcessCrash);
  // Appends `event` (its index set) and replaces the stored job, with its
  // event_count one past that index, in one transaction: a reader, and a
  // restarted coordinator, see the state change in both or in neither.
  absl::Status PutJobWithEvent(v1::Job& job, v1::JobEvent& event);
  // NOT_FOUND names the id.
  absl::StatusOr<v1::Job> GetJob(const std::string& id);

  // Jobs with seq > after_seq in seq order, at most `limit`, whose state is
  // in `states` (all when empty). *more is set when further jobs match.
  absl::StatusOr<std::vector<v1::Job>> ListJobs(int64_t after_seq, int limit,
                                                const std::vector<v1::JobState>& states,
                                                bool* more);
  // The page of `query`; *more is set when further jobs match.
  absl::StatusOr<std::vector<v1::Job>> ListJobs(const JobQuery& query, bool* more);

  // Appends events / log lines (one transaction), setting each one's index.
  absl::Status AppendEvents(std::vector<v1::JobEvent>& events);
  absl::Status AppendLogs(std::vector<v1::LogEntry>& logs);
  // Up to `limit` events / lines of a job with index >= from, in order.
  absl::StatusOr<std::vector<v1::JobEvent>> ReadEvents(const std::string& id, int64_t from, int limit);
  absl::StatusOr<std::vector<v1::LogEntry>> ReadLogs(const std::string& id, int64_t from, int limit);
  // How many events the job has had (its next event index).
  absl::StatusOr<int64_t> EventCount(const std::string& id);

  // The latest memory timeline of each (job, rank): each one given replaces
  // that rank's (one transaction). Read back in rank order; none: empty.
  absl::Status PutMemoryTimelines(const std::vector<JobMemoryTimeline>& timelines);
  absl::StatusOr<std::vector<v1::MemoryTimeline>> ReadMemoryTimelines(const std::string& id);

  // Every rank's report of every step (one row per job, attempt, step and
  // rank; a row already stored is kept: a re-sent report is not a change).
  // They are the durable buffer of the steps not yet complete (a restarted
  // coordinator reads them back) and the per-rank detail a watch may ask for.
  absl::Status PutRankSteps(const std::vector<JobRankStep>& steps);
  // The reports of attempt `attempt` with from_step <= step <= to_step, by
  // step then rank.
  absl::StatusOr<std::vector<v1::StepTelemetry>> ReadRankSteps(const std::string& id, int attempt,
                                                               int64_t from_step, int64_t to_step);
  // The job's latest step event (JobEvent.job_step), if any: where a
  // restarted coordinator resumes (NOT_FOUND when none).
  absl::StatusOr<v1::JobStepSummary> LastStepSummary(const std::string& id);

  // How many jobs are in each state (the coordinator's jobs-by-state gauge
  // at start-up).
  absl::StatusOr<std::map<v1::JobState, int64_t>> CountJobsByState();
  // Removes the job's events, logs, memory timelines and rank reports, at
  // most `max_rows` rows a call (one transaction), so that a job of
  // millions of rank reports does not hold the store, and the coordinator's
  // lock, for seconds: the retention of a finished job, which gets no
  // further events. True once nothing of its data is left; *deleted (when
  // given): the rows this call removed. Indices are never reused (the
  // highest goes last; NextIndex reads where they went).
  absl::StatusOr<bool> DeleteJobDataPart(const std::string& id, int64_t max_rows, int64_t* deleted = nullptr);
  // Records that a DeleteJob of `id` by `caller` has begun and, when given,
  // replaces the job's record with `marked` (its events_deleted_time set),
  // in one transaction: the delete's first write. Its data then goes in
  // parts (DeleteJobDataPart), each its own transaction, and the record
  // last (DeleteJob, which also removes this one), so a restart between
  // them finds the delete here (UnfinishedDeletes) and finishes it. No
  // `marked` for a record that does not parse (it is deleted all the same).
  absl::Status BeginDelete(const std::string& id, const std::string& caller, const v1::Job* marked);
  // The deletes begun and not finished (a restart cut them short), by id.
  absl::StatusOr<std::vector<UnfinishedDelete>> UnfinishedDeletes();
  // Drops the record of a delete under way of `id` (the job itself stays):
  // for records no DeleteJob could have written. OK when there is none.
  absl::Status ForgetDelete(const std::string& id);
  // Removes the job itself as well (one transaction), and its record of a
  // delete under way. NOT_FOUND names the id (the record of a delete under
  // way is removed all the same).
  absl::Status DeleteJob(const std::string& id);
  // The state column of the job's row, which stays readable when the record
  // itself is corrupt (GetJob's DATA_LOSS).
  absl::StatusOr<v1::JobState> RecordedState(const std::string& id);

  // The rendezvous store's keys (written through, so that ranks meeting
  // across a coordinator restart still find each other).
  absl::Status KvPut(const std::string& key, const std::string& value);
  absl::StatusOr<std::map<std::string, std::string>> KvAll();
  absl::Status KvDeletePrefix(const std::string& prefix);

 private:
  explicit JobStore(sqlite3* db) : db_(db) {}
  absl::Status Exec(const char* sql) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // COMMIT, or ROLLBACK when it fails.
  absl::Status Commit() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // PRAGMA synchronous for what follows (it only takes effect set outside
  // a transaction); every write says which it needs.
  absl::Status Sync(Durability durability) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // BEGIN IMMEDIATE, its COMMIT synced to disk or not (Sync).
  absl::Status Begin(Durability durability) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // DeleteJob's DELETEs of the job's data, inside its transaction.
  absl::Status DeleteDataLocked(const std::string& id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::StatusOr<int64_t> NextIndex(const char* table, const std::string& id,
                                    std::map<std::string, int64_t>& cache)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Inside a transaction: `pending` (its own appends so far), else as
  // NextIndex. The cache takes `pending` only once it commits (Remember),
  // so a failed transaction leaves it as it was without a copy of it.
  absl::StatusOr<int64_t> PendingIndex(const char* table, const std::string& id,
                                       const std::map<std::string, int64_t>& pending,
                                       std::map<std::string, int64_t>& cache) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Remember(const std::map<std::string, int64_t>& committed, std::map<std::string, int64_t>& cache)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status Error(const char* what) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  absl::Mutex mu_;
  sqlite3* const db_;
  std::map<std::string, int64_t> next_event_ ABSL_GUARDED_BY(mu_);
  Durability synced_ ABSL_GUARDED_BY(mu_) = Durability::kProcessCrash;  // the PRAGMA set now
  std::map<std::string, int64_t> next_log_ ABSL_GUARDED_BY(mu_);
};

}  // namespace plateau

#endif  // PLATEAU_SERVER_JOB_STORE_H_
