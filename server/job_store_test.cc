#include "server/job_store.h"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/test_db.h"
#include "sqlite3.h"

namespace plateau {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;

v1::Job NewJob(v1::JobState state) {
  v1::Job j;
  j.set_state(state);
  j.mutable_spec()->set_name("t");
  return j;
}

TEST(JobStoreTest, JobsSurviveReopeningWithEventsAndLogs) {
  const std::string path = TempDb("reopen");
  std::string id;
  {
    auto store = JobStore::Open(path);
    ASSERT_TRUE(store.ok()) << store.status();
    auto job = (*store)->CreateJob(NewJob(v1::PENDING));
    ASSERT_TRUE(job.ok()) << job.status();
    id = job->id();
    EXPECT_EQ(id, "job-1");
    job->set_state(v1::RUNNING);
    ASSERT_TRUE((*store)->PutJob(*job).ok());
    std::vector<v1::JobEvent> ev(3);
    for (auto& e : ev) e.set_job_id(id);
    ASSERT_TRUE((*store)->AppendEvents(ev).ok());
    EXPECT_EQ(ev[2].index(), 2);
    std::vector<v1::LogEntry> logs(2);
    for (auto& l : logs) l.set_job_id(id), l.set_line("hello");
    ASSERT_TRUE((*store)->AppendLogs(logs).ok());
  }
  auto store = JobStore::Open(path);
  ASSERT_TRUE(store.ok());
  auto job = (*store)->GetJob(id);
  ASSERT_TRUE(job.ok());
  EXPECT_EQ(job->state(), v1::RUNNING);
  std::vector<v1::JobEvent> more(1);
  more[0].set_job_id(id);
  ASSERT_TRUE((*store)->AppendEvents(more).ok());
  EXPECT_EQ(more[0].index(), 3);  // indices continue after a restart
  auto events = (*store)->ReadEvents(id, 1, 100);
  ASSERT_TRUE(events.ok());
  ASSERT_EQ(events->size(), 3u);
  EXPECT_EQ((*events)[0].index(), 1);
  auto logs = (*store)->ReadLogs(id, 0, 100);
  ASSERT_TRUE(logs.ok());
  EXPECT_EQ(logs->size(), 2u);
  auto second = (*store)->CreateJob(NewJob(v1::PENDING));
  EXPECT_EQ(second->id(), "job-2");
}

// Runs `sql` on the database at `path` from a second connection, as
// another process could.
void ExecOn(const std::string& path, const std::string& sql) {
  sqlite3* db = nullptr;
  ASSERT_EQ(sqlite3_open(path.c_str(), &db), SQLITE_OK);
  char* err = nullptr;
  const int rc = sqlite3_exec(db, sql.c_str(), nullptr, nullptr, &err);
  EXPECT_EQ(rc, SQLITE_OK) << (err ? err : "");
  sqlite3_free(err);
  sqlite3_close(db);
}

// A state change's event and its job row are one transaction: when the
// row's update fails, the event is not kept either (before, the event was
// committed alone, and a restarted coordinator wrote it a second time, or
// ran a job whose events already said CANCELLED).
TEST(JobStoreTest, AStateChangeIsStoredWithItsEventOrNotAtAll) {
  const std::string path = TempDb("state_change");
  auto store = JobStore::Open(path);
  ASSERT_TRUE(store.ok()) << store.status();
  auto job = (*store)->CreateJob(NewJob(v1::RUNNING));
  ASSERT_TRUE(job.ok()) << job.status();
  ExecOn(path, absl::StrCat("CREATE TRIGGER refuse BEFORE UPDATE ON jobs WHEN NEW.state = ", v1::SUCCEEDED,
                            " BEGIN SELECT RAISE(ABORT, 'refused by the test'); END"));
  v1::JobEvent ev;
  ev.set_job_id(job->id());
  ev.mutable_state_change()->set_state(v1::SUCCEEDED);
  job->set_state(v1::SUCCEEDED);
  const absl::Status refused = (*store)->PutJobWithEvent(*job, ev);
  EXPECT_THAT(refused.message(), HasSubstr("refused by the test"));
  auto events = (*store)->ReadEvents(job->id(), 0, 10);
  ASSERT_TRUE(events.ok()) << events.status();
  EXPECT_TRUE(events->empty()) << "the event outlived its failed state change";
  EXPECT_EQ((*store)->GetJob(job->id())->state(), v1::RUNNING);

  // The store works on (no transaction left open), and the index the
  // failed change took is given again.
  ExecOn(path, "DROP TRIGGER refuse");
  ASSERT_TRUE((*store)->PutJobWithEvent(*job, ev).ok());
  EXPECT_EQ(ev.index(), 0);
  auto stored = (*store)->GetJob(job->id());
  ASSERT_TRUE(stored.ok()) << stored.status();
  EXPECT_EQ(stored->state(), v1::SUCCEEDED);
  EXPECT_EQ(stored->event_count(), 1);
  events = (*store)->ReadEvents(job->id(), 0, 10);
  ASSERT_TRUE(events.ok()) << events.status();
  ASSERT_EQ(events->size(), 1u);
  EXPECT_EQ((*events)[0].state_change().state(), v1::SUCCEEDED);

  v1::JobEvent other;
  other.set_job_id("job-7");
  EXPECT_EQ((*store)->PutJobWithEvent(*job, other).code(), absl::StatusCode::kInvalidArgument);
}

// A submitted job and its first event are one transaction: when the event
// cannot be stored, neither is the job (two writes left a job the client
// was told had failed, run after a restart).
TEST(JobStoreTest, AJobIsCreatedWithItsFirstEventOrNotAtAll) {
  const std::string path = TempDb("create_with_event");
  auto store = JobStore::Open(path);
  ASSERT_TRUE(store.ok()) << store.status();
  ExecOn(path, "CREATE TRIGGER refuse BEFORE INSERT ON events BEGIN SELECT RAISE(ABORT, 'refused by the test'); END");
  v1::JobEvent submitted;
  submitted.mutable_state_change()->set_state(v1::PENDING);
  auto refused = (*store)->CreateJob(NewJob(v1::PENDING), &submitted);
  EXPECT_THAT(refused.status().message(), HasSubstr("refused by the test"));
  bool more = false;
  auto listed = (*store)->ListJobs(0, 10, {}, &more);
  ASSERT_TRUE(listed.ok()) << listed.status();
  EXPECT_TRUE(listed->empty()) << "the job outlived its failed first event";

  ExecOn(path, "DROP TRIGGER refuse");
  auto job = (*store)->CreateJob(NewJob(v1::PENDING), &submitted);
  ASSERT_TRUE(job.ok()) << job.status();
  EXPECT_EQ(job->event_count(), 1);
  EXPECT_EQ(submitted.job_id(), job->id());
  EXPECT_EQ(submitted.index(), 0);
  EXPECT_EQ((*store)->GetJob(job->id())->event_count(), 1);
  // The next event follows it.
  std::vector<v1::JobEvent> next(1);
  next[0].set_job_id(job->id());
  ASSERT_TRUE((*store)->AppendEvents(next).ok());
  EXPECT_EQ(next[0].index(), 1);
  auto events = (*store)->ReadEvents(job->id(), 0, 10);
  ASSERT_TRUE(events.ok()) << events.status();
  ASSERT_EQ(events->size(), 2u);
  EXPECT_EQ((*events)[0].state_change().state(), v1::PENDING);
}

// A VFS over the default one that counts the syncs of WAL files: what a
// commit made durable against a power loss (a process crash needs none).
std::atomic<int> wal_syncs{0};
sqlite3_vfs* real_vfs = nullptr;
struct CountingFile {
  sqlite3_file base;
  bool wal;
  sqlite3_file* real() { return reinterpret_cast<sqlite3_file*>(this + 1); }
};
sqlite3_file* Real(sqlite3_file* f) { return reinterpret_cast<CountingFile*>(f)->real(); }
const sqlite3_io_methods counting_methods = {
    3,
    [](sqlite3_file* f) { return Real(f)->pMethods->xClose(Real(f)); },
    [](sqlite3_file* f, void* p, int n, sqlite3_int64 o) { return Real(f)->pMethods->xRead(Real(f), p, n, o); },
    [](sqlite3_file* f, const void* p, int n, sqlite3_int64 o) { return Real(f)->pMethods->xWrite(Real(f), p, n, o); },
    [](sqlite3_file* f, sqlite3_int64 n) { return Real(f)->pMethods->xTruncate(Real(f), n); },
    [](sqlite3_file* f, int flags) {
      if (reinterpret_cast<CountingFile*>(f)->wal) ++wal_syncs;
      return Real(f)->pMethods->xSync(Real(f), flags);
    },
    [](sqlite3_file* f, sqlite3_int64* n) { return Real(f)->pMethods->xFileSize(Real(f), n); },
    [](sqlite3_file* f, int l) { return Real(f)->pMethods->xLock(Real(f), l); },
    [](sqlite3_file* f, int l) { return Real(f)->pMethods->xUnlock(Real(f), l); },
    [](sqlite3_file* f, int* r) { return Real(f)->pMethods->xCheckReservedLock(Real(f), r); },
    [](sqlite3_file* f, int op, void* a) { return Real(f)->pMethods->xFileControl(Real(f), op, a); },
    [](sqlite3_file* f) { return Real(f)->pMethods->xSectorSize(Real(f)); },
    [](sqlite3_file* f) { return Real(f)->pMethods->xDeviceCharacteristics(Real(f)); },
    [](sqlite3_file* f, int i, int sz, int e, void volatile** p) {
      return Real(f)->pMethods->xShmMap(Real(f), i, sz, e, p);
    },
    [](sqlite3_file* f, int o, int n, int fl) { return Real(f)->pMethods->xShmLock(Real(f), o, n, fl); },
    [](sqlite3_file* f) { Real(f)->pMethods->xShmBarrier(Real(f)); },
    [](sqlite3_file* f, int d) { return Real(f)->pMethods->xShmUnmap(Real(f), d); },
    [](sqlite3_file* f, sqlite3_int64 o, int n, void** p) { return Real(f)->pMethods->xFetch(Real(f), o, n, p); },
    [](sqlite3_file* f, sqlite3_int64 o, void* p) { return Real(f)->pMethods->xUnfetch(Real(f), o, p); },
};

// What a reply acknowledges (a submit, a state change, a delete) is synced
// to disk before the reply; telemetry's many small commits are not. Before,
// no commit synced (synchronous=NORMAL): a power loss could lose an
// acknowledged job and hand its id out again.
TEST(JobStoreTest, AcknowledgedChangesAreSyncedAndTelemetryIsNot) {
  real_vfs = sqlite3_vfs_find(nullptr);
  ASSERT_NE(real_vfs, nullptr);
  static sqlite3_vfs counting = *real_vfs;
  counting.zName = "plateau-counting";
  counting.szOsFile = static_cast<int>(sizeof(CountingFile)) + real_vfs->szOsFile;
  counting.xOpen = [](sqlite3_vfs*, const char* name, sqlite3_file* f, int flags, int* out) {
    auto* c = reinterpret_cast<CountingFile*>(f);
    const int rc = real_vfs->xOpen(real_vfs, name, c->real(), flags, out);
    if (rc != SQLITE_OK) {
      f->pMethods = nullptr;
      return rc;
    }
    c->wal = (flags & SQLITE_OPEN_WAL) != 0;
    f->pMethods = &counting_methods;
    return SQLITE_OK;
  };
  ASSERT_EQ(sqlite3_vfs_register(&counting, /*makeDflt=*/1), SQLITE_OK);
  struct Unregister {
    ~Unregister() { sqlite3_vfs_unregister(&counting); }
  } unregister;

  auto store = JobStore::Open(TempDb("synced"));
  ASSERT_TRUE(store.ok()) << store.status();
  int before = wal_syncs.load();
  v1::JobEvent submitted;
  auto job = (*store)->CreateJob(NewJob(v1::PENDING), &submitted);
  ASSERT_TRUE(job.ok()) << job.status();
  EXPECT_GT(wal_syncs.load(), before) << "a submit was acknowledged before its commit reached the disk";

  before = wal_syncs.load();
  std::vector<v1::LogEntry> lines(3);
  for (auto& l : lines) l.set_job_id(job->id());
  ASSERT_TRUE((*store)->AppendLogs(lines).ok());
  std::vector<v1::JobEvent> steps(2);
  for (auto& e : steps) e.set_job_id(job->id());
  ASSERT_TRUE((*store)->AppendEvents(steps).ok());
  EXPECT_EQ(wal_syncs.load(), before) << "telemetry's commits synced (one fsync each, under the coordinator's lock)";

  before = wal_syncs.load();
  v1::JobEvent ran;
  ran.set_job_id(job->id());
  job->set_state(v1::CANCELLED);
  ASSERT_TRUE((*store)->PutJobWithEvent(*job, ran).ok());
  EXPECT_GT(wal_syncs.load(), before) << "a state change was acknowledged before its commit reached the disk";

  // A write outside a transaction says its own durability: progress is
  // not synced even right after a synced state change (it took the mode
  // the last transaction left), a recorded rank exit is.
  before = wal_syncs.load();
  ASSERT_TRUE((*store)->PutJob(*job).ok());
  EXPECT_EQ(wal_syncs.load(), before) << "a progress write synced";
  ASSERT_TRUE((*store)->PutJob(*job, JobStore::Durability::kPowerLoss).ok());
  EXPECT_GT(wal_syncs.load(), before) << "a rank's recorded exit was not synced";

  before = wal_syncs.load();
  ASSERT_TRUE((*store)->DeleteJob(job->id()).ok());
  EXPECT_GT(wal_syncs.load(), before) << "a delete was acknowledged before its commit reached the disk";
}

// A batch that fails takes no index (the next batch reuses them), and the
// index cache stays right past its bound (it keeps the jobs it was last
// written for, not every job ever: each batch copied the whole of it).
TEST(JobStoreTest, EventIndicesSurviveAFailedBatchAndTheCachesBound) {
  const std::string path = TempDb("event_indices");
  auto store = JobStore::Open(path);
  ASSERT_TRUE(store.ok()) << store.status();
  auto append = [&](const std::vector<std::string>& ids) {
    std::vector<v1::JobEvent> events(ids.size());
    for (size_t i = 0; i < ids.size(); ++i) events[i].set_job_id(ids[i]);
    absl::Status s = (*store)->AppendEvents(events);
    std::vector<int64_t> idx;
    for (const auto& e : events) idx.push_back(e.index());
    return std::make_pair(s, idx);
  };
  EXPECT_EQ(append({"job-1", "job-1"}).second, (std::vector<int64_t>{0, 1}));
  ExecOn(path,
         "CREATE TRIGGER refuse BEFORE INSERT ON events WHEN NEW.job = 'job-2' "
         "BEGIN SELECT RAISE(ABORT, 'refused by the test'); END");
  EXPECT_THAT(append({"job-1", "job-2"}).first.message(), HasSubstr("refused by the test"));
  ExecOn(path, "DROP TRIGGER refuse");
  EXPECT_EQ(append({"job-1", "job-2"}).second, (std::vector<int64_t>{2, 0}));
  // Past the cache's bound (4096 jobs): each job's next index still follows
  // what is stored.
  std::vector<std::string> many;
  for (int j = 10; j < 4200; ++j) many.push_back(absl::StrCat("job-", j));
  ASSERT_TRUE(append(many).first.ok());
  EXPECT_EQ(append({"job-1", "job-2", "job-10", "job-4199"}).second, (std::vector<int64_t>{3, 1, 1, 1}));
  EXPECT_EQ(*(*store)->EventCount("job-1"), 4);
}

// One transaction larger than the WAL limit (a large delete) grows the
// write-ahead log past it; once a checkpoint has emptied the log, the next
// write cuts the file back to the limit instead of keeping it for good.
TEST(JobStoreTest, TheWriteAheadLogIsCutBackAfterALargeTransaction) {
  const std::string path = TempDb("wal_limit");
  auto store = JobStore::Open(path);
  ASSERT_TRUE(store.ok()) << store.status();
  const int64_t limit = JobStore::kWalSizeLimitBytes;
  std::vector<JobRankStep> big(limit / 2000);  // ~4 KiB of log a row: ~2x the limit
  for (size_t i = 0; i < big.size(); ++i) {
    big[i].job_id = "job-1";
    big[i].telemetry.set_step(static_cast<int64_t>(i) + 1);
    big[i].telemetry.add_peak()->set_live_set(std::string(1000, 'x'));
  }
  ASSERT_TRUE((*store)->PutRankSteps(big).ok());
  const std::string wal = path + "-wal";
  ASSERT_GT(static_cast<int64_t>(std::filesystem::file_size(wal)), limit) << "the test's transaction is too small";
  ExecOn(path, "PRAGMA wal_checkpoint(PASSIVE)");  // as SQLite's autocheckpoint does
  std::vector<JobRankStep> one(1);
  one[0].job_id = "job-2";
  one[0].telemetry.set_step(1);
  ASSERT_TRUE((*store)->PutRankSteps(one).ok());  // reuses the emptied log
  EXPECT_LE(static_cast<int64_t>(std::filesystem::file_size(wal)), limit);
}

// A job's data deleted in parts of at most N rows (each a transaction of
// its own): done only once every table is empty, and the indices still
// never reused.
TEST(JobStoreTest, AJobsDataIsDeletedInPartsOfBoundedRows) {
  auto store = JobStore::Open(TempDb("delete_parts"));
  ASSERT_TRUE(store.ok()) << store.status();
  const std::string id = "job-1";
  std::vector<v1::JobEvent> events(5);
  std::vector<v1::LogEntry> logs(5);
  std::vector<JobRankStep> steps(7);
  for (auto& e : events) e.set_job_id(id);
  for (auto& l : logs) l.set_job_id(id);
  for (int i = 0; i < 7; ++i) {
    steps[i].job_id = id;
    steps[i].telemetry.set_step(i + 1);
  }
  ASSERT_TRUE((*store)->AppendEvents(events).ok());
  ASSERT_TRUE((*store)->AppendLogs(logs).ok());
  ASSERT_TRUE((*store)->PutRankSteps(steps).ok());
  std::vector<v1::JobEvent> other(1);
  other[0].set_job_id("job-2");
  ASSERT_TRUE((*store)->AppendEvents(other).ok());
  int parts = 0;
  for (bool done = false; !done; ++parts) {
    absl::StatusOr<bool> d = (*store)->DeleteJobDataPart(id, 4);
    ASSERT_TRUE(d.ok()) << d.status();
    done = *d;
    ASSERT_LT(parts, 10);
  }
  EXPECT_EQ(parts, 5);  // 17 rows, 4 a part: the fifth finds the rest
  EXPECT_TRUE((*store)->ReadEvents(id, 0, 100)->empty());
  EXPECT_TRUE((*store)->ReadLogs(id, 0, 100)->empty());
  EXPECT_TRUE((*store)->ReadRankSteps(id, 0, 0, INT64_MAX)->empty());
  EXPECT_EQ((*store)->ReadEvents("job-2", 0, 100)->size(), 1u) << "another job's rows went too";
  std::vector<v1::JobEvent> after(1);
  after[0].set_job_id(id);
  ASSERT_TRUE((*store)->AppendEvents(after).ok());
  EXPECT_EQ(after[0].index(), 5);
}

// A part leaves the highest event index for last (lowest keys first): a
// store reopened mid-delete (a restarted coordinator, whose cache is
// empty) still appends after it, never reusing an index a watcher saw.
TEST(JobStoreTest, AStoreReopenedMidDeleteNeverReusesAnIndex) {
  const std::string path = TempDb("delete_reopen");
  {
    auto store = JobStore::Open(path);
    ASSERT_TRUE(store.ok()) << store.status();
    std::vector<v1::JobEvent> events(6);
    for (auto& e : events) e.set_job_id("job-1");
    ASSERT_TRUE((*store)->AppendEvents(events).ok());
    absl::StatusOr<bool> done = (*store)->DeleteJobDataPart("job-1", 4);
    ASSERT_TRUE(done.ok()) << done.status();
    ASSERT_FALSE(*done);
  }
  auto store = JobStore::Open(path);
  ASSERT_TRUE(store.ok()) << store.status();
  auto left = (*store)->ReadEvents("job-1", 0, 100);
  ASSERT_TRUE(left.ok());
  ASSERT_EQ(left->size(), 2u);
  EXPECT_EQ((*left)[1].index(), 5) << "a part deleted the highest index first";
  std::vector<v1::JobEvent> next(1);
  next[0].set_job_id("job-1");
  ASSERT_TRUE((*store)->AppendEvents(next).ok());
  EXPECT_EQ(next[0].index(), 6);
}

// A delete's first write records it as begun with the job's mark, in one
// transaction; a store reopened before its end (a restarted coordinator)
// lists it, with its caller; the job's removal removes the record too, and
// a record whose job is already gone is removed by a DeleteJob that finds
// no job. A record that does not parse is recorded without a mark.
TEST(JobStoreTest, ADeleteBegunIsRecordedUntilItsJobIsDeleted) {
  const std::string path = TempDb("delete_begun");
  std::string id, unmarked;
  {
    auto store = JobStore::Open(path);
    ASSERT_TRUE(store.ok()) << store.status();
    auto job = (*store)->CreateJob(NewJob(v1::SUCCEEDED));
    ASSERT_TRUE(job.ok()) << job.status();
    id = job->id();
    auto other = (*store)->CreateJob(NewJob(v1::FAILED));
    ASSERT_TRUE(other.ok()) << other.status();
    unmarked = other->id();
    EXPECT_TRUE((*store)->UnfinishedDeletes()->empty());
    v1::Job marked = *job;
    marked.mutable_events_deleted_time()->set_seconds(1234);
    ASSERT_TRUE((*store)->BeginDelete(id, "CN=alice", &marked).ok());
    ASSERT_TRUE((*store)->BeginDelete(unmarked, "", nullptr).ok());
    // Another job's record as the mark is refused, and writes nothing.
    EXPECT_EQ((*store)->BeginDelete(id, "", &*other).code(), absl::StatusCode::kInvalidArgument);
  }
  auto store = JobStore::Open(path);
  ASSERT_TRUE(store.ok()) << store.status();
  auto begun = (*store)->UnfinishedDeletes();
  ASSERT_TRUE(begun.ok()) << begun.status();
  ASSERT_EQ(begun->size(), 2u);
  EXPECT_EQ((*begun)[0].job_id, id);
  EXPECT_EQ((*begun)[0].caller, "CN=alice");
  EXPECT_EQ((*begun)[1].job_id, unmarked);
  EXPECT_EQ((*begun)[1].caller, "");
  EXPECT_EQ((*store)->GetJob(id)->events_deleted_time().seconds(), 1234);
  EXPECT_FALSE((*store)->GetJob(unmarked)->has_events_deleted_time());
  ASSERT_TRUE((*store)->DeleteJob(id).ok());
  ASSERT_EQ((*store)->UnfinishedDeletes()->size(), 1u);
  ASSERT_TRUE((*store)->DeleteJob(unmarked).ok());
  EXPECT_TRUE((*store)->UnfinishedDeletes()->empty());
  // Of a job already gone: NOT_FOUND, and the record goes all the same.
  ASSERT_TRUE((*store)->BeginDelete("job-99", "", nullptr).ok());
  EXPECT_EQ((*store)->DeleteJob("job-99").code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE((*store)->UnfinishedDeletes()->empty());
  // A mark for a job that is not there writes nothing.
  v1::Job ghost = NewJob(v1::SUCCEEDED);
  ghost.set_id("job-98");
  EXPECT_EQ((*store)->BeginDelete("job-98", "", &ghost).code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE((*store)->UnfinishedDeletes()->empty());
}

TEST(JobStoreTest, ListPagesAndFilters) {
  auto store = JobStore::Open(TempDb("list"));
  ASSERT_TRUE(store.ok());
  for (int i = 0; i < 7; ++i) {
    ASSERT_TRUE((*store)->CreateJob(NewJob(i % 3 == 0 ? v1::CANCELLED : v1::PENDING)).ok());
  }
  std::set<std::string> seen;
  int64_t after = 0;
  bool more = true;
  int pages = 0;
  while (more) {
    auto page = (*store)->ListJobs(after, 3, {}, &more);
    ASSERT_TRUE(page.ok());
    ++pages;
    for (const auto& j : *page) {
      EXPECT_TRUE(seen.insert(j.id()).second) << j.id();
      after = *ParseJobId(j.id());
    }
  }
  EXPECT_EQ(pages, 3);
  EXPECT_EQ(seen.size(), 7u);
  auto cancelled = (*store)->ListJobs(0, 10, {v1::CANCELLED}, &more);
  ASSERT_TRUE(cancelled.ok());
  EXPECT_EQ(cancelled->size(), 3u);  // jobs 1, 4, 7
  EXPECT_FALSE(more);
}

// Jobs of large specs: a page ends at the byte bound (never before its
// first job, whatever its size), the next continues, every job once; with
// a predicate too.
TEST(JobStoreTest, APageEndsAtItsByteBound) {
  auto store = JobStore::Open(TempDb("page_bytes"));
  ASSERT_TRUE(store.ok());
  for (int i = 0; i < 9; ++i) {
    v1::Job j = NewJob(v1::PENDING);
    j.mutable_spec()->set_name(std::string(i == 4 ? 5000 : 250, 'n'));  // job 5 alone passes the bound
    ASSERT_TRUE((*store)->CreateJob(j).ok());
  }
  for (bool selective : {false, true}) {
    JobQuery q;
    q.limit = 50;
    q.max_bytes = 1000;
    if (selective) q.match = [](const v1::Job& j) { return *ParseJobId(j.id()) != 2; };
    std::vector<size_t> sizes;
    std::vector<int64_t> got;
    bool more = true;
    while (more) {
      auto page = (*store)->ListJobs(q, &more);
      ASSERT_TRUE(page.ok()) << page.status();
      ASSERT_FALSE(page->empty());
      int64_t bytes = 0;
      for (const v1::Job& j : *page) {
        got.push_back(*ParseJobId(j.id()));
        bytes += static_cast<int64_t>(j.ByteSizeLong());
      }
      if (page->size() > 1) {
        EXPECT_LE(bytes, q.max_bytes);
      }
      sizes.push_back(page->size());
      q.cursor = got.back();
    }
    std::vector<int64_t> want;
    for (int64_t s = 1; s <= 9; ++s) {
      if (!selective || s != 2) want.push_back(s);
    }
    EXPECT_EQ(got, want);
    // Three of ~280 bytes a page; job 5 a page of its own.
    EXPECT_EQ(sizes, selective ? (std::vector<size_t>{3, 1, 3, 1}) : (std::vector<size_t>{3, 1, 1, 3, 1}));
  }
}

// A selective predicate (a label selector) pages through a history several
// scan batches long, both ways, and the store serves other calls while the
// predicate runs: the predicate's first call waits for a GetJob on another
// thread, which would wait for the store's lock if the scan held it.
TEST(JobStoreTest, ASelectiveListScansInBatchesWithoutHoldingTheStore) {
  auto store = JobStore::Open(TempDb("scan"));
  ASSERT_TRUE(store.ok());
  const int64_t n = 3 * kListScanRows + 7;
  std::vector<int64_t> every_100th;
  for (int64_t i = 1; i <= n; ++i) {
    auto job = (*store)->CreateJob(NewJob(v1::PENDING));
    ASSERT_TRUE(job.ok()) << job.status();
    const int64_t seq = *ParseJobId(job->id());
    if (seq % 100 == 0) every_100th.push_back(seq);
  }
  ASSERT_EQ(every_100th.size(), static_cast<size_t>(n / 100));
  for (bool newest_first : {false, true}) {
    JobQuery q;
    q.newest_first = newest_first;
    q.limit = 2;
    bool other_call_done = false;
    absl::Notification done;
    std::thread other;  // joined once the listing is over: it may wait for the scan's lock
    q.match = [&](const v1::Job& j) {
      if (!other.joinable()) {
        other = std::thread([&store, &done, id = j.id()] {
          EXPECT_TRUE((*store)->GetJob(id).ok());
          done.Notify();
        });
        other_call_done = done.WaitForNotificationWithTimeout(absl::Seconds(5));
      }
      return *ParseJobId(j.id()) % 100 == 0;
    };
    std::vector<int64_t> got;
    bool more = true;
    while (more) {
      auto page = (*store)->ListJobs(q, &more);
      ASSERT_TRUE(page.ok()) << page.status();
      ASSERT_LE(page->size(), 2u);
      for (const v1::Job& j : *page) got.push_back(*ParseJobId(j.id()));
      if (!page->empty()) q.cursor = got.back();
    }
    other.join();
    std::vector<int64_t> want = every_100th;
    if (newest_first) std::reverse(want.begin(), want.end());
    EXPECT_EQ(got, want) << (newest_first ? "newest first" : "oldest first");
    EXPECT_TRUE(other_call_done) << "GetJob waited for the scan to finish";
  }
}

TEST(JobStoreTest, UnknownAndMalformedIds) {
  auto store = JobStore::Open(TempDb("ids"));
  ASSERT_TRUE(store.ok());
  EXPECT_EQ((*store)->GetJob("job-9").status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT((*store)->GetJob("job-9").status().message(), HasSubstr("job-9"));
  EXPECT_EQ((*store)->GetJob("nine").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ((*store)->GetJob("job--1").status().code(), absl::StatusCode::kInvalidArgument);
  // Only the canonical spelling of an existing job: its rows are keyed by
  // it, so another spelling would find the job but not its events or logs.
  v1::Job job;
  job.set_state(v1::PENDING);
  auto put = (*store)->CreateJob(job);
  ASSERT_TRUE(put.ok()) << put.status();
  const std::string id = put->id();
  ASSERT_TRUE((*store)->GetJob(id).ok());
  for (const std::string& other :
       {absl::StrCat("job-0", id.substr(4)), absl::StrCat("job-+", id.substr(4)),
        absl::StrCat("job- ", id.substr(4)), absl::StrCat(id, " "), std::string("job-")}) {
    auto got = (*store)->GetJob(other);
    EXPECT_EQ(got.status().code(), absl::StatusCode::kInvalidArgument) << "'" << other << "'";
    EXPECT_THAT(got.status().message(), HasSubstr("expected a job id like 'job-12'"))
        << "'" << other << "'";
  }
}

v1::MemoryTimeline Timeline(int rank, int64_t step, int64_t weights) {
  v1::MemoryTimeline t;
  t.set_rank(rank);
  t.set_step(step);
  t.add_live_sets("weights");
  v1::MemoryTimelinePhase* p = t.add_phases();
  p->set_name("forward 0");
  p->add_device_bytes(weights);
  p->add_device_peak_bytes(weights + 1);
  return t;
}

// The latest timeline of each rank replaces that rank's, per job, and all of
// it is still there after the database is opened again.
TEST(JobStoreTest, MemoryTimelinesRoundTripAndSurviveReopening) {
  const std::string path = TempDb("timelines");
  {
    auto store = JobStore::Open(path);
    ASSERT_TRUE(store.ok()) << store.status();
    auto none = (*store)->ReadMemoryTimelines("job-1");
    ASSERT_TRUE(none.ok()) << none.status();
    EXPECT_TRUE(none->empty());
    ASSERT_TRUE((*store)->PutMemoryTimelines({{"job-1", Timeline(1, 1, 10)}, {"job-1", Timeline(0, 1, 20)},
                                               {"job-2", Timeline(0, 1, 30)}}).ok());
    // Step 100 of rank 1 replaces its step 1; rank 0 keeps step 1.
    ASSERT_TRUE((*store)->PutMemoryTimelines({{"job-1", Timeline(1, 100, 40)}}).ok());
  }
  auto store = JobStore::Open(path);
  ASSERT_TRUE(store.ok()) << store.status();
  auto one = (*store)->ReadMemoryTimelines("job-1");
  ASSERT_TRUE(one.ok()) << one.status();
  ASSERT_EQ(one->size(), 2u);
  EXPECT_EQ((*one)[0].rank(), 0);
  EXPECT_EQ((*one)[0].step(), 1);
  EXPECT_EQ((*one)[0].phases(0).device_bytes(0), 20);
  EXPECT_EQ((*one)[1].rank(), 1);
  EXPECT_EQ((*one)[1].step(), 100);
  EXPECT_EQ((*one)[1].phases(0).name(), "forward 0");
  EXPECT_EQ((*one)[1].phases(0).device_bytes(0), 40);
  EXPECT_EQ((*one)[1].phases(0).device_peak_bytes(0), 41);
  auto two = (*store)->ReadMemoryTimelines("job-2");
  ASSERT_TRUE(two.ok());
  ASSERT_EQ(two->size(), 1u);
  EXPECT_EQ((*two)[0].phases(0).device_bytes(0), 30);
}

TEST(JobStoreTest, UnwritableDirectoryIsAnError) {
  auto store = JobStore::Open("/nonexistent-dir/x/state.db");
  EXPECT_FALSE(store.ok());
  EXPECT_THAT(store.status().message(), HasSubstr("/nonexistent-dir/x/state.db"));
}

// Another program's database, a file that is not one, and a newer
// Plateau's are refused naming the path, and left as they were (opening
// one switched it to WAL mode, then failed "no such column: state"). A
// database of a Plateau from before the stamp opens and is stamped.
TEST(JobStoreTest, AForeignOrNewerDatabaseIsRefusedUnchanged) {
  const auto bytes = [](const std::string& path) {
    std::ifstream in(path, std::ios::binary);
    return std::string(std::istreambuf_iterator<char>(in), {});
  };
  const std::string foreign = TempDb("foreign");
  ExecOn(foreign, "CREATE TABLE jobs (id INTEGER PRIMARY KEY, spec TEXT); INSERT INTO jobs VALUES (1, 'x')");
  const std::string before = bytes(foreign);
  auto store = JobStore::Open(foreign);
  EXPECT_EQ(store.status().code(), absl::StatusCode::kFailedPrecondition) << store.status();
  EXPECT_THAT(store.status().message(), AllOf(HasSubstr(foreign), HasSubstr("not a Plateau state database")));
  EXPECT_EQ(bytes(foreign), before) << "the refused database was changed";

  const std::string stamped = TempDb("stamped");
  ExecOn(stamped, "PRAGMA application_id = 42; CREATE TABLE t (x)");
  EXPECT_THAT(JobStore::Open(stamped).status().message(), HasSubstr("application_id 0x0000002a"));

  const std::string garbage = TempDb("garbage");
  { std::ofstream(garbage) << std::string(4096, 'x'); }
  store = JobStore::Open(garbage);
  EXPECT_EQ(store.status().code(), absl::StatusCode::kFailedPrecondition) << store.status();
  EXPECT_THAT(store.status().message(), AllOf(HasSubstr(garbage), HasSubstr("not an SQLite database")));

  const std::string newer = TempDb("newer");
  ASSERT_TRUE(JobStore::Open(newer).ok());
  ExecOn(newer, "PRAGMA user_version = 2");
  store = JobStore::Open(newer);
  EXPECT_EQ(store.status().code(), absl::StatusCode::kFailedPrecondition) << store.status();
  EXPECT_THAT(store.status().message(), AllOf(HasSubstr(newer), HasSubstr("schema version 2")));

  // Before the stamp: our tables, application_id 0. Opens, keeps its job.
  const std::string older = TempDb("older");
  {
    auto s = JobStore::Open(older);
    ASSERT_TRUE(s.ok()) << s.status();
    ASSERT_TRUE((*s)->CreateJob(NewJob(v1::PENDING)).ok());
  }
  ExecOn(older, "PRAGMA application_id = 0; PRAGMA user_version = 0");
  store = JobStore::Open(older);
  ASSERT_TRUE(store.ok()) << store.status();
  EXPECT_TRUE((*store)->GetJob("job-1").ok());
}

// The request id is recorded with its job in one transaction: one job per
// id, found again after reopening.
TEST(JobStoreTest, RequestIdsAreUniqueAndSurviveReopening) {
  const std::string path = TempDb("requests");
  {
    auto store = JobStore::Open(path);
    ASSERT_TRUE(store.ok()) << store.status();
    v1::Job job = NewJob(v1::PENDING);
    job.set_request_id("req-1");
    ASSERT_TRUE((*store)->CreateJob(job).ok());
    auto twice = (*store)->CreateJob(job);
    EXPECT_EQ(twice.status().code(), absl::StatusCode::kAlreadyExists) << twice.status();
    EXPECT_THAT(std::string(twice.status().message()), HasSubstr("request_id 'req-1'"));
    ASSERT_TRUE((*store)->CreateJob(NewJob(v1::PENDING)).ok());  // no id: no record
  }
  auto store = JobStore::Open(path);
  ASSERT_TRUE(store.ok());
  auto found = (*store)->FindRequest("req-1");
  ASSERT_TRUE(found.ok()) << found.status();
  ASSERT_TRUE(found->has_value());
  EXPECT_EQ(**found, "job-1");
  EXPECT_FALSE((*store)->FindRequest("req-2")->has_value());
  EXPECT_FALSE((*store)->FindRequest("")->has_value());
  // The refused duplicate left no job behind (its insert was rolled back).
  bool more = false;
  auto all = (*store)->ListJobs(JobQuery{}, &more);
  ASSERT_TRUE(all.ok());
  ASSERT_EQ(all->size(), 2u);
  EXPECT_EQ((*all)[1].request_id(), "");

  // A deleted job frees its request id: the same id then creates a new job.
  ASSERT_TRUE((*store)->DeleteJob("job-1").ok());
  EXPECT_FALSE((*store)->FindRequest("req-1")->has_value());
  v1::Job again = NewJob(v1::PENDING);
  again.set_request_id("req-1");
  auto created = (*store)->CreateJob(again);
  ASSERT_TRUE(created.ok()) << created.status();
  EXPECT_EQ(**(*store)->FindRequest("req-1"), created->id());
}

// Overwrites rows with bytes that do not parse, behind the store's back
// (a damaged disk, a hand edit).
// A corrupt record is DATA_LOSS naming its row, so that an operator can find
// it; a corrupt job's row can still be deleted, and the rest read again.
TEST(JobStoreTest, CorruptRecordsAreNamedAndACorruptJobCanBeDeleted) {
  const std::string path = TempDb("corrupt");
  {
    auto store = JobStore::Open(path);
    ASSERT_TRUE(store.ok()) << store.status();
    for (int i = 0; i < 3; ++i) ASSERT_TRUE((*store)->CreateJob(NewJob(v1::SUCCEEDED)).ok());
    std::vector<v1::JobEvent> ev(3);
    for (auto& e : ev) e.set_job_id("job-1");
    ASSERT_TRUE((*store)->AppendEvents(ev).ok());
    std::vector<v1::LogEntry> logs(2);
    for (auto& l : logs) l.set_job_id("job-1"), l.set_line("hello");
    ASSERT_TRUE((*store)->AppendLogs(logs).ok());
  }
  ExecOn(path,
         "UPDATE jobs SET job = x'ffffffff' WHERE seq = 2;"
         "UPDATE events SET event = x'ffffffff' WHERE job = 'job-1' AND idx = 1;"
         "UPDATE logs SET entry = x'ffffffff' WHERE job = 'job-1' AND idx = 1;");
  auto store = JobStore::Open(path);
  ASSERT_TRUE(store.ok()) << store.status();
  bool more = false;
  auto listed = (*store)->ListJobs(0, 10, {}, &more);
  EXPECT_EQ(listed.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(listed.status().message(), HasSubstr("job-2: corrupt record in the state database"));
  EXPECT_THAT(listed.status().message(), HasSubstr("plateauctl delete job-2"));
  EXPECT_EQ((*store)->GetJob("job-2").status().code(), absl::StatusCode::kDataLoss);
  ASSERT_TRUE((*store)->GetJob("job-3").ok());

  auto events = (*store)->ReadEvents("job-1", 0, 10);
  EXPECT_EQ(events.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(events.status().message(), HasSubstr("job-1: event 1 is a corrupt record"));
  auto logs = (*store)->ReadLogs("job-1", 0, 10);
  EXPECT_THAT(logs.status().message(), HasSubstr("job-1: log line 1 is a corrupt record"));
  EXPECT_TRUE((*store)->ReadEvents("job-1", 2, 10).ok()) << "the rows after it";

  auto state = (*store)->RecordedState("job-2");
  ASSERT_TRUE(state.ok()) << state.status();
  EXPECT_EQ(*state, v1::SUCCEEDED);
  ASSERT_TRUE((*store)->DeleteJob("job-2").ok());
  listed = (*store)->ListJobs(0, 10, {}, &more);
  ASSERT_TRUE(listed.ok()) << listed.status();
  ASSERT_EQ(listed->size(), 2u);
  EXPECT_EQ((*listed)[1].id(), "job-3");
}

}  // namespace
}  // namespace plateau
