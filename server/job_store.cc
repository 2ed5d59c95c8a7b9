#include "server/job_store.h"

#include <sqlite3.h>

#include <cstdint>
#include <limits>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "kernels/status_macros.h"

namespace plateau {
namespace {

constexpr char kSchema[] = R"sql(
CREATE TABLE IF NOT EXISTS jobs (
  seq   INTEGER PRIMARY KEY AUTOINCREMENT,
  state INTEGER NOT NULL,
  job   BLOB NOT NULL
);
CREATE INDEX IF NOT EXISTS jobs_by_state ON jobs(state, seq);
CREATE TABLE IF NOT EXISTS events (
  job   TEXT NOT NULL,
  idx   INTEGER NOT NULL,
  event BLOB NOT NULL,
  PRIMARY KEY (job, idx)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS logs (
  job   TEXT NOT NULL,
  idx   INTEGER NOT NULL,
  entry BLOB NOT NULL,
  PRIMARY KEY (job, idx)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS memory_timelines (
  job      TEXT NOT NULL,
  rank     INTEGER NOT NULL,
  timeline BLOB NOT NULL,
  PRIMARY KEY (job, rank)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS rank_steps (
  job       TEXT NOT NULL,
  attempt   INTEGER NOT NULL,
  step      INTEGER NOT NULL,
  rank      INTEGER NOT NULL,
  telemetry BLOB NOT NULL,
  PRIMARY KEY (job, attempt, step, rank)
) WITHOUT ROWID;
-- SubmitJobRequest.request_id -> the job it created (idempotent submit;
-- a table of its own, so that a database of an earlier version gains it
-- without a migration).
CREATE TABLE IF NOT EXISTS requests (
  request_id TEXT PRIMARY KEY,
  seq        INTEGER NOT NULL
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS kv (
  key   TEXT PRIMARY KEY,
  value BLOB NOT NULL
) WITHOUT ROWID;
-- The DeleteJobs under way (BeginDelete .. DeleteJob), so that a restart
-- finishes one cut short. A table of its own, so that a database of an
-- earlier version gains it without a migration (and an earlier coordinator
-- ignores it: its jobs then read as swept until deleted again, as before).
CREATE TABLE IF NOT EXISTS deletes (
  job    TEXT PRIMARY KEY,
  caller TEXT NOT NULL
) WITHOUT ROWID;
)sql";

// PRAGMA application_id of a Plateau state database ("PLTU"), and the
// schema's version (PRAGMA user_version). Version 1: the tables above.
// A later version that changes a table bumps it and migrates from each
// earlier one in Open; an older binary refuses a newer database.
constexpr int64_t kApplicationId = 0x504C5455;
constexpr int64_t kSchemaVersion = 1;

// A prepared statement, finalized on scope exit.
class Stmt {
 public:
  Stmt(sqlite3* db, const char* sql) { rc_ = sqlite3_prepare_v2(db, sql, -1, &s_, nullptr); }
  ~Stmt() { sqlite3_finalize(s_); }
  bool ok() const { return rc_ == SQLITE_OK; }
  sqlite3_stmt* get() { return s_; }
  void Bind(int i, int64_t v) { sqlite3_bind_int64(s_, i, v); }
  void Bind(int i, const std::string& v) {
    sqlite3_bind_blob(s_, i, v.data(), static_cast<int>(v.size()), SQLITE_TRANSIENT);
  }
  void BindText(int i, const std::string& v) {
    sqlite3_bind_text(s_, i, v.data(), static_cast<int>(v.size()), SQLITE_TRANSIENT);
  }
  int Step() { return sqlite3_step(s_); }
  std::string Blob(int col) {
    const void* p = sqlite3_column_blob(s_, col);
    if (p == nullptr) return std::string();  // NULL, or an empty value
    return std::string(static_cast<const char*>(p), sqlite3_column_bytes(s_, col));
  }
  int64_t Int(int col) { return sqlite3_column_int64(s_, col); }

 private:
  sqlite3_stmt* s_ = nullptr;
  int rc_;
};

}  // namespace

absl::StatusOr<int64_t> ParseJobId(const std::string& id, const char* field) {
  int64_t seq = 0;
  // Only the canonical spelling: the job's rows (events, logs, timelines)
  // are keyed by it, so "job-07" or "job-+7" would find the job but none of
  // its data, and a delete would leave that behind.
  if (id.rfind("job-", 0) != 0 || !absl::SimpleAtoi(id.substr(4), &seq) || seq < 1 ||
      JobIdOf(seq) != id) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ": expected a job id like 'job-12', got '", id.substr(0, 64), "'"));
  }
  return seq;
}

std::string JobIdOf(int64_t seq) { return absl::StrCat("job-", seq); }

namespace {
// DATA_LOSS naming the row, so that an operator can find and clear it.
absl::Status CorruptJob(int64_t seq) {
  return absl::DataLossError(
      absl::StrCat(JobIdOf(seq),
                   ": corrupt record in the state database (its row in table jobs "
                   "does not parse); a finished job's row goes with: plateauctl delete ",
                   JobIdOf(seq)));
}

absl::Status CorruptRow(const std::string& id, const char* what, int64_t idx) {
  return absl::DataLossError(absl::StrCat(
      id, ": ", what, " ", idx, " is a corrupt record in the state database (does not parse)"));
}
}  // namespace

absl::StatusOr<std::unique_ptr<JobStore>> JobStore::Open(const std::string& path) {
  sqlite3* db = nullptr;
  if (sqlite3_open_v2(path.c_str(), &db, SQLITE_OPEN_READWRITE | SQLITE_OPEN_CREATE | SQLITE_OPEN_FULLMUTEX,
                      nullptr) != SQLITE_OK) {
    std::string msg = db ? sqlite3_errmsg(db) : "out of memory";
    sqlite3_close(db);
    return absl::UnavailableError(absl::StrCat("state database ", path, ": ", msg));
  }
  std::unique_ptr<JobStore> store(new JobStore(db));
  absl::MutexLock lock(&store->mu_);
  sqlite3_busy_timeout(db, 5000);
  // Whose file this is, before anything is written to it (WAL mode below
  // changes the file): another program's database, or a newer Plateau's,
  // is refused naming the path.
  const auto refuse = [&](const std::string& why) {
    return absl::FailedPreconditionError(
        absl::StrCat("state database ", path, ": ", why, "; give the coordinator its own --state_dir"));
  };
  const auto pragma = [&](const char* sql) -> absl::StatusOr<int64_t> {
    Stmt q(db, sql);
    if (!q.ok() || q.Step() != SQLITE_ROW) {
      const int rc = sqlite3_errcode(db);
      const std::string msg = sqlite3_errmsg(db);
      if (rc == SQLITE_NOTADB || rc == SQLITE_CORRUPT)
        return refuse(absl::StrCat("not an SQLite database (", msg, ")"));
      return absl::UnavailableError(absl::StrCat("state database ", path, ": ", msg));
    }
    return q.Int(0);
  };
  PLATEAU_ASSIGN_OR_RETURN(const int64_t application_id, pragma("PRAGMA application_id"));
  PLATEAU_ASSIGN_OR_RETURN(const int64_t version, pragma("PRAGMA user_version"));
  PLATEAU_ASSIGN_OR_RETURN(const int64_t tables, pragma("SELECT count(*) FROM sqlite_master WHERE type = 'table'"));
  if (application_id != kApplicationId && application_id != 0) {
    return refuse(absl::StrFormat("not a Plateau state database (application_id 0x%08x)", application_id));
  }
  if (application_id == 0 && tables > 0) {
    // Unstamped with tables: a database of a Plateau from before the stamp
    // (its jobs table is ours), or another program's.
    PLATEAU_ASSIGN_OR_RETURN(
        const int64_t ours,
        pragma("SELECT count(*) FROM pragma_table_info('jobs') WHERE name IN ('seq', 'state', 'job')"));
    if (ours != 3) return refuse("not a Plateau state database (it holds other tables)");
  }
  if (version > kSchemaVersion) {
    return refuse(absl::StrCat("written by a newer Plateau (schema version ", version, "; this one knows ",
                               kSchemaVersion, " and earlier)"));
  }
  // WAL: readers never block the writer. NORMAL sync is durable across a
  // process crash (the WAL is synced at checkpoints); the transactions a
  // reply acknowledges are synced on commit too (Begin).
  {
    // A file system without shared memory (some network ones) refuses WAL
    // and SQLite quietly keeps the rollback journal: say so.
    Stmt wal(db, "PRAGMA journal_mode=WAL");
    const std::string mode = wal.ok() && wal.Step() == SQLITE_ROW ? wal.Blob(0) : "";
    if (mode != "wal") {
      return absl::UnavailableError(absl::StrCat("state database ", path, ": cannot use WAL mode (journal mode '", mode,
                                                 "': ", sqlite3_errmsg(db),
                                                 "); put --state_dir on a local file system"));
    }
  }
  PLATEAU_RETURN_IF_ERROR(store->Exec("PRAGMA synchronous=NORMAL"));
  // The WAL grows to hold a whole transaction (a large delete: 490 MiB) and
  // SQLite keeps the file at that size for good unless told to cut it back
  // when it is next reused after a checkpoint.
  PLATEAU_RETURN_IF_ERROR(store->Exec(absl::StrCat("PRAGMA journal_size_limit = ", kWalSizeLimitBytes).c_str()));
  PLATEAU_RETURN_IF_ERROR(store->Exec(kSchema));
  PLATEAU_RETURN_IF_ERROR(store->Exec(absl::StrCat("PRAGMA application_id = ", kApplicationId).c_str()));
  PLATEAU_RETURN_IF_ERROR(store->Exec(absl::StrCat("PRAGMA user_version = ", kSchemaVersion).c_str()));
  return store;
}

JobStore::~JobStore() { sqlite3_close(db_); }

absl::Status JobStore::Error(const char* what) {
  return absl::InternalError(absl::StrCat("state database: ", what, ": ", sqlite3_errmsg(db_)));
}

absl::Status JobStore::Exec(const char* sql) {
  char* err = nullptr;
  if (sqlite3_exec(db_, sql, nullptr, nullptr, &err) != SQLITE_OK) {
    std::string msg = err ? err : "unknown error";
    sqlite3_free(err);
    return absl::InternalError(absl::StrCat("state database: ", msg));
  }
  return absl::OkStatus();
}

absl::Status JobStore::Sync(Durability durability) {
  if (durability != synced_) {
    PLATEAU_RETURN_IF_ERROR(
        Exec(durability == Durability::kPowerLoss ? "PRAGMA synchronous=FULL" : "PRAGMA synchronous=NORMAL"));
    synced_ = durability;
  }
  return absl::OkStatus();
}

absl::Status JobStore::Begin(Durability durability) {
  PLATEAU_RETURN_IF_ERROR(Sync(durability));
  return Exec("BEGIN IMMEDIATE");
}

absl::Status JobStore::Commit() {
  // A COMMIT that fails (SQLITE_BUSY, a full disk) leaves the transaction
  // open: ended here, or the next BEGIN would fail and readers on this
  // connection would see the uncommitted rows.
  absl::Status s = Exec("COMMIT");
  if (!s.ok()) Exec("ROLLBACK").IgnoreError();
  return s;
}

absl::StatusOr<v1::Job> JobStore::CreateJob(v1::Job job, v1::JobEvent* first_event) {
  absl::MutexLock lock(&mu_);
  PLATEAU_RETURN_IF_ERROR(Begin(Durability::kPowerLoss));
  Stmt ins(db_, "INSERT INTO jobs (state, job) VALUES (?, ?)");
  ins.Bind(1, job.state());
  ins.Bind(2, std::string());
  if (!ins.ok() || ins.Step() != SQLITE_DONE) {
    absl::Status s = Error("insert job");
    Exec("ROLLBACK").IgnoreError();
    return s;
  }
  const int64_t seq = sqlite3_last_insert_rowid(db_);
  job.set_id(JobIdOf(seq));
  if (!job.request_id().empty()) {
    Stmt req(db_, "INSERT INTO requests (request_id, seq) VALUES (?, ?)");
    req.BindText(1, job.request_id());
    req.Bind(2, seq);
    const int rc = req.ok() ? req.Step() : SQLITE_ERROR;
    if (rc != SQLITE_DONE) {
      absl::Status s = (sqlite3_extended_errcode(db_) == SQLITE_CONSTRAINT_PRIMARYKEY)
                           ? absl::AlreadyExistsError(absl::StrCat("request_id '", job.request_id(),
                                                                   "' already created a job"))
                           : Error("record request id");
      Exec("ROLLBACK").IgnoreError();
      return s;
    }
  }
  if (first_event != nullptr) {
    first_event->set_job_id(job.id());
    first_event->set_index(0);  // a new id: no event can exist yet
    Stmt ins(db_, "INSERT INTO events (job, idx, event) VALUES (?, 0, ?)");
    ins.BindText(1, job.id());
    ins.Bind(2, first_event->SerializeAsString());
    if (!ins.ok() || ins.Step() != SQLITE_DONE) {
      absl::Status s = Error("append the job's first event");
      Exec("ROLLBACK").IgnoreError();
      return s;
    }
    job.set_event_count(1);
  }
  Stmt upd(db_, "UPDATE jobs SET job = ? WHERE seq = ?");
  upd.Bind(1, job.SerializeAsString());
  upd.Bind(2, seq);
  if (!upd.ok() || upd.Step() != SQLITE_DONE) {
    absl::Status s = Error("store job");
    Exec("ROLLBACK").IgnoreError();
    return s;
  }
  PLATEAU_RETURN_IF_ERROR(Commit());
  if (first_event != nullptr) next_event_[job.id()] = 1;
  return job;
}

absl::StatusOr<std::optional<std::string>> JobStore::FindRequest(const std::string& request_id) {
  absl::MutexLock lock(&mu_);
  Stmt q(db_, "SELECT seq FROM requests WHERE request_id = ?");
  if (!q.ok()) return Error("read request id");
  q.BindText(1, request_id);
  const int rc = q.Step();
  if (rc == SQLITE_DONE) return std::optional<std::string>();
  if (rc != SQLITE_ROW) return Error("read request id");
  return std::optional<std::string>(JobIdOf(q.Int(0)));
}

absl::Status JobStore::PutJob(const v1::Job& job, Durability durability) {
  PLATEAU_ASSIGN_OR_RETURN(int64_t seq, ParseJobId(job.id()));
  absl::MutexLock lock(&mu_);
  PLATEAU_RETURN_IF_ERROR(Sync(durability));  // one statement: its own transaction
  Stmt upd(db_, "UPDATE jobs SET state = ?, job = ? WHERE seq = ?");
  upd.Bind(1, job.state());
  upd.Bind(2, job.SerializeAsString());
  upd.Bind(3, seq);
  if (!upd.ok() || upd.Step() != SQLITE_DONE) return Error("update job");
  if (sqlite3_changes(db_) != 1) return absl::NotFoundError(absl::StrCat("job '", job.id(), "' not found"));
  return absl::OkStatus();
}

absl::Status JobStore::PutJobWithEvent(v1::Job& job, v1::JobEvent& event) {
  PLATEAU_ASSIGN_OR_RETURN(int64_t seq, ParseJobId(job.id()));
  if (event.job_id() != job.id()) {
    return absl::InvalidArgumentError(
        absl::StrCat("event of job '", event.job_id(), "' stored with job '", job.id(), "'"));
  }
  absl::MutexLock lock(&mu_);
  PLATEAU_RETURN_IF_ERROR(Begin(Durability::kPowerLoss));
  const auto failed = [&](absl::Status s) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    Exec("ROLLBACK").IgnoreError();
    return s;
  };
  absl::StatusOr<int64_t> idx = NextIndex("events", job.id(), next_event_);
  if (!idx.ok()) return failed(idx.status());
  event.set_index(*idx);
  Stmt ins(db_, "INSERT INTO events (job, idx, event) VALUES (?, ?, ?)");
  ins.BindText(1, job.id());
  ins.Bind(2, *idx);
  ins.Bind(3, event.SerializeAsString());
  if (!ins.ok() || ins.Step() != SQLITE_DONE) return failed(Error("append event"));
  job.set_event_count(*idx + 1);
  Stmt upd(db_, "UPDATE jobs SET state = ?, job = ? WHERE seq = ?");
  upd.Bind(1, job.state());
  upd.Bind(2, job.SerializeAsString());
  upd.Bind(3, seq);
  if (!upd.ok() || upd.Step() != SQLITE_DONE) return failed(Error("update job"));
  if (sqlite3_changes(db_) != 1) return failed(absl::NotFoundError(absl::StrCat("job '", job.id(), "' not found")));
  PLATEAU_RETURN_IF_ERROR(Commit());
  next_event_[job.id()] = *idx + 1;
  return absl::OkStatus();
}

absl::StatusOr<v1::Job> JobStore::GetJob(const std::string& id) {
  PLATEAU_ASSIGN_OR_RETURN(int64_t seq, ParseJobId(id));
  absl::MutexLock lock(&mu_);
  Stmt q(db_, "SELECT job FROM jobs WHERE seq = ?");
  q.Bind(1, seq);
  if (!q.ok()) return Error("read job");
  int rc = q.Step();
  if (rc == SQLITE_DONE) return absl::NotFoundError(absl::StrCat("job '", id, "' not found"));
  if (rc != SQLITE_ROW) return Error("read job");
  v1::Job job;
  if (!job.ParseFromString(q.Blob(0))) return CorruptJob(seq);
  return job;
}

absl::StatusOr<std::vector<v1::Job>> JobStore::ListJobs(int64_t after_seq, int limit,
                                                        const std::vector<v1::JobState>& states,
                                                        bool* more) {
  JobQuery q;
  q.cursor = after_seq;
  q.limit = limit;
  q.states = states;
  return ListJobs(q, more);
}

absl::StatusOr<std::vector<v1::Job>> JobStore::ListJobs(const JobQuery& query, bool* more) {
  std::string sql = "SELECT job, seq FROM jobs WHERE ";
  sql += query.newest_first ? "seq < ?" : "seq > ?";
  if (!query.states.empty()) {
    sql += " AND state IN (";
    for (size_t i = 0; i < query.states.size(); ++i) {
      absl::StrAppend(&sql, i ? "," : "", static_cast<int>(query.states[i]));
    }
    sql += ")";
  }
  sql += query.newest_first ? " ORDER BY seq DESC LIMIT ?" : " ORDER BY seq LIMIT ?";
  // Without a predicate one read of the page and one more row (for *more)
  // does. With one, rows are read in batches until a page and one more
  // have matched; each batch is parsed and matched outside the lock.
  const int64_t batch = query.match ? kListScanRows : int64_t{query.limit} + 1;
  int64_t from = query.cursor > 0 ? query.cursor : (query.newest_first ? std::numeric_limits<int64_t>::max() : 0);
  std::vector<v1::Job> jobs;
  int64_t page_bytes = 0;
  bool full = false;  // the byte bound ended the page
  for (;;) {
    std::vector<std::pair<int64_t, std::string>> rows;
    bool cut = false;  // rows stopped at the byte bound, not at the table's end
    {
      absl::MutexLock lock(&mu_);
      Stmt q(db_, sql.c_str());
      if (!q.ok()) return Error("list jobs");
      q.Bind(1, from);
      q.Bind(2, batch);
      int rc;
      int64_t read = 0;
      while ((rc = q.Step()) == SQLITE_ROW) {
        rows.emplace_back(q.Int(1), q.Blob(0));
        read += static_cast<int64_t>(rows.back().second.size());
        if (query.max_bytes > 0 && page_bytes + read > query.max_bytes) {
          cut = true;
          break;
        }
      }
      if (!cut && rc != SQLITE_DONE) return Error("list jobs");
    }
    for (auto& [seq, blob] : rows) {
      v1::Job job;
      if (!job.ParseFromString(blob)) {
        if (query.corrupt == nullptr) return CorruptJob(seq);
        query.corrupt->push_back(seq);
        continue;
      }
      if (query.match && !query.match(job)) continue;
      const int64_t bytes = static_cast<int64_t>(blob.size());
      if (query.max_bytes > 0 && !jobs.empty() && page_bytes + bytes > query.max_bytes) {
        full = true;
        break;
      }
      page_bytes += bytes;
      jobs.push_back(std::move(job));
      if (static_cast<int>(jobs.size()) > query.limit) break;
    }
    if (full || static_cast<int>(jobs.size()) > query.limit || (!cut && static_cast<int64_t>(rows.size()) < batch)) {
      break;
    }
    from = rows.back().first;
    if (query.between_reads) {
      if (absl::Status s = query.between_reads(); !s.ok()) return s;
    }
  }
  if (full) {
    *more = true;
    return jobs;
  }
  *more = static_cast<int>(jobs.size()) > query.limit;
  if (*more) jobs.pop_back();
  return jobs;
}

absl::StatusOr<int64_t> JobStore::NextIndex(const char* table, const std::string& id,
                                            std::map<std::string, int64_t>& cache) {
  auto it = cache.find(id);
  if (it != cache.end()) return it->second;
  Stmt q(db_, absl::StrCat("SELECT COALESCE(MAX(idx) + 1, 0) FROM ", table, " WHERE job = ?").c_str());
  if (!q.ok()) return Error("read index");
  q.BindText(1, id);
  if (q.Step() != SQLITE_ROW) return Error("read index");
  int64_t next = q.Int(0);
  cache[id] = next;
  return next;
}

absl::StatusOr<int64_t> JobStore::PendingIndex(const char* table, const std::string& id,
                                               const std::map<std::string, int64_t>& pending,
                                               std::map<std::string, int64_t>& cache) {
  if (auto it = pending.find(id); it != pending.end()) return it->second;
  return NextIndex(table, id, cache);  // caches only what is committed
}

void JobStore::Remember(const std::map<std::string, int64_t>& committed, std::map<std::string, int64_t>& cache) {
  // Bounded: every job ever written would otherwise stay (a finished job's
  // entry is never used again); a dropped entry costs one indexed MAX query.
  constexpr size_t kMaxCached = 4096;
  size_t added = 0;
  for (const auto& entry : committed) added += cache.count(entry.first) == 0 ? 1 : 0;
  if (cache.size() + added > kMaxCached) cache.clear();
  for (const auto& [id, next] : committed) cache[id] = next;
}

absl::Status JobStore::AppendEvents(std::vector<v1::JobEvent>& events) {
  if (events.empty()) return absl::OkStatus();
  absl::MutexLock lock(&mu_);
  PLATEAU_RETURN_IF_ERROR(Begin(Durability::kProcessCrash));
  std::map<std::string, int64_t> next;  // this transaction's jobs only
  for (v1::JobEvent& e : events) {
    auto idx = PendingIndex("events", e.job_id(), next, next_event_);
    if (!idx.ok()) {
      Exec("ROLLBACK").IgnoreError();
      return idx.status();
    }
    e.set_index(*idx);
    Stmt ins(db_, "INSERT INTO events (job, idx, event) VALUES (?, ?, ?)");
    ins.BindText(1, e.job_id());
    ins.Bind(2, *idx);
    ins.Bind(3, e.SerializeAsString());
    if (!ins.ok() || ins.Step() != SQLITE_DONE) {
      absl::Status s = Error("append event");
      Exec("ROLLBACK").IgnoreError();
      return s;
    }
    next[e.job_id()] = *idx + 1;
  }
  PLATEAU_RETURN_IF_ERROR(Commit());
  Remember(next, next_event_);
  return absl::OkStatus();
}

absl::Status JobStore::AppendLogs(std::vector<v1::LogEntry>& logs) {
  if (logs.empty()) return absl::OkStatus();
  absl::MutexLock lock(&mu_);
  PLATEAU_RETURN_IF_ERROR(Begin(Durability::kProcessCrash));
  std::map<std::string, int64_t> next;  // this transaction's jobs only
  for (v1::LogEntry& e : logs) {
    auto idx = PendingIndex("logs", e.job_id(), next, next_log_);
    if (!idx.ok()) {
      Exec("ROLLBACK").IgnoreError();
      return idx.status();
    }
    e.set_index(*idx);
    Stmt ins(db_, "INSERT INTO logs (job, idx, entry) VALUES (?, ?, ?)");
    ins.BindText(1, e.job_id());
    ins.Bind(2, *idx);
    ins.Bind(3, e.SerializeAsString());
    if (!ins.ok() || ins.Step() != SQLITE_DONE) {
      absl::Status s = Error("append log");
      Exec("ROLLBACK").IgnoreError();
      return s;
    }
    next[e.job_id()] = *idx + 1;
  }
  PLATEAU_RETURN_IF_ERROR(Commit());
  Remember(next, next_log_);
  return absl::OkStatus();
}

absl::Status JobStore::PutMemoryTimelines(const std::vector<JobMemoryTimeline>& timelines) {
  if (timelines.empty()) return absl::OkStatus();
  absl::MutexLock lock(&mu_);
  PLATEAU_RETURN_IF_ERROR(Begin(Durability::kProcessCrash));
  for (const JobMemoryTimeline& t : timelines) {
    Stmt put(db_, "INSERT OR REPLACE INTO memory_timelines (job, rank, timeline) VALUES (?, ?, ?)");
    put.BindText(1, t.job_id);
    put.Bind(2, static_cast<int64_t>(t.timeline.rank()));
    put.Bind(3, t.timeline.SerializeAsString());
    if (!put.ok() || put.Step() != SQLITE_DONE) {
      absl::Status s = Error("store memory timeline");
      Exec("ROLLBACK").IgnoreError();
      return s;
    }
  }
  return Commit();
}

absl::StatusOr<std::vector<v1::MemoryTimeline>> JobStore::ReadMemoryTimelines(const std::string& id) {
  absl::MutexLock lock(&mu_);
  Stmt q(db_, "SELECT timeline FROM memory_timelines WHERE job = ? ORDER BY rank");
  if (!q.ok()) return Error("read memory timelines");
  q.BindText(1, id);
  std::vector<v1::MemoryTimeline> out;
  int rc;
  while ((rc = q.Step()) == SQLITE_ROW) {
    v1::MemoryTimeline t;
    if (!t.ParseFromString(q.Blob(0))) {
      return absl::DataLossError(absl::StrCat("memory timeline of '", id, "': corrupt record"));
    }
    out.push_back(std::move(t));
  }
  if (rc != SQLITE_DONE) return Error("read memory timelines");
  return out;
}

absl::StatusOr<std::vector<v1::JobEvent>> JobStore::ReadEvents(const std::string& id, int64_t from,
                                                               int limit) {
  absl::MutexLock lock(&mu_);
  Stmt q(db_, "SELECT event, idx FROM events WHERE job = ? AND idx >= ? ORDER BY idx LIMIT ?");
  if (!q.ok()) return Error("read events");
  q.BindText(1, id);
  q.Bind(2, from);
  q.Bind(3, static_cast<int64_t>(limit));
  std::vector<v1::JobEvent> out;
  int rc;
  while ((rc = q.Step()) == SQLITE_ROW) {
    v1::JobEvent e;
    if (!e.ParseFromString(q.Blob(0))) return CorruptRow(id, "event", q.Int(1));
    out.push_back(std::move(e));
  }
  if (rc != SQLITE_DONE) return Error("read events");
  return out;
}

absl::StatusOr<std::vector<v1::LogEntry>> JobStore::ReadLogs(const std::string& id, int64_t from,
                                                             int limit) {
  absl::MutexLock lock(&mu_);
  Stmt q(db_, "SELECT entry, idx FROM logs WHERE job = ? AND idx >= ? ORDER BY idx LIMIT ?");
  if (!q.ok()) return Error("read logs");
  q.BindText(1, id);
  q.Bind(2, from);
  q.Bind(3, static_cast<int64_t>(limit));
  std::vector<v1::LogEntry> out;
  int rc;
  while ((rc = q.Step()) == SQLITE_ROW) {
    v1::LogEntry e;
    if (!e.ParseFromString(q.Blob(0))) return CorruptRow(id, "log line", q.Int(1));
    out.push_back(std::move(e));
  }
  if (rc != SQLITE_DONE) return Error("read logs");
  return out;
}

absl::StatusOr<int64_t> JobStore::EventCount(const std::string& id) {
  absl::MutexLock lock(&mu_);
  return NextIndex("events", id, next_event_);
}

absl::Status JobStore::PutRankSteps(const std::vector<JobRankStep>& steps) {
  if (steps.empty()) return absl::OkStatus();
  absl::MutexLock lock(&mu_);
  PLATEAU_RETURN_IF_ERROR(Begin(Durability::kProcessCrash));
  for (const JobRankStep& r : steps) {
    Stmt put(db_, "INSERT OR IGNORE INTO rank_steps (job, attempt, step, rank, telemetry) VALUES (?, ?, ?, ?, ?)");
    put.BindText(1, r.job_id);
    put.Bind(2, static_cast<int64_t>(r.telemetry.attempt()));
    put.Bind(3, r.telemetry.step());
    put.Bind(4, static_cast<int64_t>(r.telemetry.rank()));
    put.Bind(5, r.telemetry.SerializeAsString());
    if (!put.ok() || put.Step() != SQLITE_DONE) {
      absl::Status s = Error("store rank steps");
      Exec("ROLLBACK").IgnoreError();
      return s;
    }
  }
  return Commit();
}

absl::StatusOr<std::vector<v1::StepTelemetry>> JobStore::ReadRankSteps(const std::string& id, int attempt,
                                                                       int64_t from_step, int64_t to_step) {
  absl::MutexLock lock(&mu_);
  Stmt q(db_,
         "SELECT telemetry FROM rank_steps WHERE job = ? AND attempt = ? AND step >= ? AND step <= ? "
         "ORDER BY step, rank");
  if (!q.ok()) return Error("read rank steps");
  q.BindText(1, id);
  q.Bind(2, static_cast<int64_t>(attempt));
  q.Bind(3, from_step);
  q.Bind(4, to_step);
  std::vector<v1::StepTelemetry> out;
  int rc;
  while ((rc = q.Step()) == SQLITE_ROW) {
    v1::StepTelemetry t;
    if (!t.ParseFromString(q.Blob(0))) {
      return absl::DataLossError(
          absl::StrCat(id, ": a rank's report of attempt ", attempt,
                       " is a corrupt record in the state database (does not parse)"));
    }
    out.push_back(std::move(t));
  }
  if (rc != SQLITE_DONE) return Error("read rank steps");
  return out;
}

absl::StatusOr<v1::JobStepSummary> JobStore::LastStepSummary(const std::string& id) {
  absl::MutexLock lock(&mu_);
  // Newest first: only state changes can follow the last step event, and a
  // job has few of those.
  Stmt q(db_, "SELECT event, idx FROM events WHERE job = ? ORDER BY idx DESC");
  if (!q.ok()) return Error("read events");
  q.BindText(1, id);
  int rc;
  while ((rc = q.Step()) == SQLITE_ROW) {
    v1::JobEvent e;
    if (!e.ParseFromString(q.Blob(0))) return CorruptRow(id, "event", q.Int(1));
    if (e.has_job_step()) return e.job_step();
  }
  if (rc != SQLITE_DONE) return Error("read events");
  return absl::NotFoundError(absl::StrCat("job '", id, "' has no step event"));
}

absl::StatusOr<std::map<v1::JobState, int64_t>> JobStore::CountJobsByState() {
  absl::MutexLock lock(&mu_);
  Stmt q(db_, "SELECT state, COUNT(*) FROM jobs GROUP BY state");
  if (!q.ok()) return Error("count jobs");
  std::map<v1::JobState, int64_t> out;
  int rc;
  while ((rc = q.Step()) == SQLITE_ROW) out[static_cast<v1::JobState>(q.Int(0))] = q.Int(1);
  if (rc != SQLITE_DONE) return Error("count jobs");
  return out;
}

absl::Status JobStore::DeleteDataLocked(const std::string& id) {
  for (const char* sql : {"DELETE FROM events WHERE job = ?", "DELETE FROM logs WHERE job = ?",
                          "DELETE FROM memory_timelines WHERE job = ?", "DELETE FROM rank_steps WHERE job = ?"}) {
    Stmt del(db_, sql);
    del.BindText(1, id);
    if (!del.ok() || del.Step() != SQLITE_DONE) return Error("delete a job's data");
  }
  return absl::OkStatus();
}

absl::StatusOr<bool> JobStore::DeleteJobDataPart(const std::string& id, int64_t max_rows, int64_t* deleted) {
  absl::MutexLock lock(&mu_);
  PLATEAU_RETURN_IF_ERROR(NextIndex("events", id, next_event_).status());
  PLATEAU_RETURN_IF_ERROR(NextIndex("logs", id, next_log_).status());
  PLATEAU_RETURN_IF_ERROR(Begin(Durability::kProcessCrash));
  // By primary key (the tables have no rowid), the largest table first,
  // lowest keys first: events and logs keep their highest index until the
  // last part, so a restart mid-sweep still reads where their indices went
  // (NextIndex) and never reuses one.
  const int64_t budget = std::max<int64_t>(1, max_rows);
  int64_t removed = 0;
  bool done = true;
  for (const char* sql :
       {"DELETE FROM rank_steps WHERE (job, attempt, step, rank) IN "
        "(SELECT job, attempt, step, rank FROM rank_steps WHERE job = ? ORDER BY attempt, step, rank LIMIT ?)",
        "DELETE FROM events WHERE (job, idx) IN (SELECT job, idx FROM events WHERE job = ? ORDER BY idx LIMIT ?)",
        "DELETE FROM logs WHERE (job, idx) IN (SELECT job, idx FROM logs WHERE job = ? ORDER BY idx LIMIT ?)",
        "DELETE FROM memory_timelines WHERE (job, rank) IN "
        "(SELECT job, rank FROM memory_timelines WHERE job = ? ORDER BY rank LIMIT ?)"}) {
    Stmt del(db_, sql);
    del.BindText(1, id);
    del.Bind(2, budget - removed);
    if (!del.ok() || del.Step() != SQLITE_DONE) {
      absl::Status s = Error("delete a job's data");
      Exec("ROLLBACK").IgnoreError();
      return s;
    }
    removed += sqlite3_changes(db_);
    if (removed >= budget) {  // this table may hold more
      done = false;
      break;
    }
  }
  PLATEAU_RETURN_IF_ERROR(Commit());
  if (deleted != nullptr) *deleted = removed;
  return done;
}

absl::StatusOr<v1::JobState> JobStore::RecordedState(const std::string& id) {
  PLATEAU_ASSIGN_OR_RETURN(int64_t seq, ParseJobId(id));
  absl::MutexLock lock(&mu_);
  Stmt q(db_, "SELECT state FROM jobs WHERE seq = ?");
  q.Bind(1, seq);
  if (!q.ok()) return Error("read job state");
  const int rc = q.Step();
  if (rc == SQLITE_DONE) return absl::NotFoundError(absl::StrCat("job '", id, "' not found"));
  if (rc != SQLITE_ROW) return Error("read job state");
  const int64_t state = q.Int(0);
  if (!v1::JobState_IsValid(state)) {
    return absl::DataLossError(absl::StrCat(id, ": the state column of its row in table jobs is ",
                                            state, ", no job state: remove the row (seq ", seq,
                                            ") by hand, with the coordinator stopped"));
  }
  return static_cast<v1::JobState>(state);
}

absl::Status JobStore::BeginDelete(const std::string& id, const std::string& caller, const v1::Job* marked) {
  PLATEAU_ASSIGN_OR_RETURN(int64_t seq, ParseJobId(id));
  if (marked != nullptr && marked->id() != id) {
    return absl::InvalidArgumentError(absl::StrCat("job '", marked->id(), "' marked for the delete of '", id, "'"));
  }
  absl::MutexLock lock(&mu_);
  PLATEAU_RETURN_IF_ERROR(Begin(Durability::kProcessCrash));
  const auto failed = [&](absl::Status s) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    Exec("ROLLBACK").IgnoreError();
    return s;
  };
  Stmt ins(db_, "INSERT OR REPLACE INTO deletes (job, caller) VALUES (?, ?)");
  ins.BindText(1, id);
  ins.BindText(2, caller);
  if (!ins.ok() || ins.Step() != SQLITE_DONE) return failed(Error("record a delete"));
  if (marked != nullptr) {
    Stmt upd(db_, "UPDATE jobs SET state = ?, job = ? WHERE seq = ?");
    upd.Bind(1, marked->state());
    upd.Bind(2, marked->SerializeAsString());
    upd.Bind(3, seq);
    if (!upd.ok() || upd.Step() != SQLITE_DONE) return failed(Error("update job"));
    if (sqlite3_changes(db_) != 1) return failed(absl::NotFoundError(absl::StrCat("job '", id, "' not found")));
  }
  return Commit();
}

absl::StatusOr<std::vector<UnfinishedDelete>> JobStore::UnfinishedDeletes() {
  absl::MutexLock lock(&mu_);
  Stmt q(db_, "SELECT job, caller FROM deletes ORDER BY job");
  if (!q.ok()) return Error("read the deletes under way");
  std::vector<UnfinishedDelete> out;
  int rc;
  while ((rc = q.Step()) == SQLITE_ROW) out.push_back({q.Blob(0), q.Blob(1)});
  if (rc != SQLITE_DONE) return Error("read the deletes under way");
  return out;
}

absl::Status JobStore::ForgetDelete(const std::string& id) {
  absl::MutexLock lock(&mu_);
  Stmt del(db_, "DELETE FROM deletes WHERE job = ?");
  del.BindText(1, id);
  if (!del.ok() || del.Step() != SQLITE_DONE) return Error("forget a delete");
  return absl::OkStatus();
}

absl::Status JobStore::DeleteJob(const std::string& id) {
  PLATEAU_ASSIGN_OR_RETURN(int64_t seq, ParseJobId(id));
  absl::MutexLock lock(&mu_);
  PLATEAU_RETURN_IF_ERROR(Begin(Durability::kPowerLoss));
  // Its record of a delete under way goes in the same transaction as the
  // job (a restart then finds neither or both), and also when the job is
  // gone already: kept, it would be resumed at every start.
  Stmt under_way(db_, "DELETE FROM deletes WHERE job = ?");
  under_way.BindText(1, id);
  if (!under_way.ok() || under_way.Step() != SQLITE_DONE) {
    absl::Status s = Error("delete a job's record of its delete");
    Exec("ROLLBACK").IgnoreError();
    return s;
  }
  Stmt del(db_, "DELETE FROM jobs WHERE seq = ?");
  del.Bind(1, seq);
  if (!del.ok() || del.Step() != SQLITE_DONE) {
    absl::Status s = Error("delete job");
    Exec("ROLLBACK").IgnoreError();
    return s;
  }
  if (sqlite3_changes(db_) != 1) {
    PLATEAU_RETURN_IF_ERROR(Commit());
    return absl::NotFoundError(absl::StrCat("job '", id, "' not found"));
  }
  // Its request id goes with it: a submit with that id after the delete is
  // a new job, not an answer naming a job that no longer exists.
  Stmt req(db_, "DELETE FROM requests WHERE seq = ?");
  req.Bind(1, seq);
  if (!req.ok() || req.Step() != SQLITE_DONE) {
    absl::Status s = Error("delete a job's request id");
    Exec("ROLLBACK").IgnoreError();
    return s;
  }
  absl::Status s = DeleteDataLocked(id);
  if (!s.ok()) {
    Exec("ROLLBACK").IgnoreError();
    return s;
  }
  PLATEAU_RETURN_IF_ERROR(Commit());
  next_event_.erase(id);
  next_log_.erase(id);
  return absl::OkStatus();
}

absl::Status JobStore::KvPut(const std::string& key, const std::string& value) {
  absl::MutexLock lock(&mu_);
  PLATEAU_RETURN_IF_ERROR(Sync(Durability::kProcessCrash));  // rendezvous keys: many, short-lived
  Stmt put(db_, "INSERT OR REPLACE INTO kv (key, value) VALUES (?, ?)");
  put.BindText(1, key);
  put.Bind(2, value);
  if (!put.ok() || put.Step() != SQLITE_DONE) return Error("store key");
  return absl::OkStatus();
}

absl::StatusOr<std::map<std::string, std::string>> JobStore::KvAll() {
  absl::MutexLock lock(&mu_);
  Stmt q(db_, "SELECT key, value FROM kv");
  if (!q.ok()) return Error("read keys");
  std::map<std::string, std::string> out;
  int rc;
  while ((rc = q.Step()) == SQLITE_ROW) {
    out[q.Blob(0)] = q.Blob(1);
  }
  if (rc != SQLITE_DONE) return Error("read keys");
  return out;
}

absl::Status JobStore::KvDeletePrefix(const std::string& prefix) {
  absl::MutexLock lock(&mu_);
  PLATEAU_RETURN_IF_ERROR(Sync(Durability::kProcessCrash));
  // A range, not LIKE: keys may contain '%' and '_'.
  Stmt del(db_, "DELETE FROM kv WHERE key >= ? AND key < ?");
  std::string end = prefix;
  end.push_back('\xff');
  del.BindText(1, prefix);
  del.BindText(2, end);
  if (!del.ok() || del.Step() != SQLITE_DONE) return Error("delete keys");
  return absl::OkStatus();
}

}  // namespace plateau
