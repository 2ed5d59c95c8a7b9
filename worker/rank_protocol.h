// What a rank process and its worker agent agree on: the exit codes of
// plateau_rank. Telemetry, errors and the exit code to come (said before
// the teardown) travel as plateau.v1.RankOutput JSON lines on the rank's
// stdout (worker.proto); everything else is a log line.
#ifndef PLATEAU_WORKER_RANK_PROTOCOL_H_
#define PLATEAU_WORKER_RANK_PROTOCOL_H_

#include <cstddef>

namespace plateau {

inline constexpr int kRankExitOk = 0;
inline constexpr int kRankExitError = 1;        // any other error
inline constexpr int kRankExitUsage = 2;        // bad command line
inline constexpr int kRankExitOutOfMemory = 3;  // RESOURCE_EXHAUSTED: a live set did not fit
inline constexpr int kRankExitInvalidJob = 4;   // the job cannot run here (bad data file, ...)

// The longest stdout line the agent reads as one line (longer ones are cut
// into pieces and become log lines). A RankOutput line must stay below it:
// a step with its memory timeline is the longest (kernels/memory_timeline.h
// bounds its phases so that it does). The agent's telemetry batch closes
// past 256 KiB, so a batch stays under 512 KiB, half the coordinator's
// smallest --max_request_bytes.
inline constexpr size_t kMaxRankOutputLineBytes = 256 << 10;

}  // namespace plateau

#endif  // PLATEAU_WORKER_RANK_PROTOCOL_H_
