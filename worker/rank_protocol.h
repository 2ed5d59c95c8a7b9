// What a rank process and its worker agent agree on: the exit codes of
// plateau_rank. Telemetry and errors travel as plateau.v1.RankOutput JSON
// lines on the rank's stdout (worker.proto); everything else is a log line.
#ifndef PLATEAU_WORKER_RANK_PROTOCOL_H_
#define PLATEAU_WORKER_RANK_PROTOCOL_H_

namespace plateau {

inline constexpr int kRankExitOk = 0;
inline constexpr int kRankExitError = 1;        // any other error
inline constexpr int kRankExitUsage = 2;        // bad command line
inline constexpr int kRankExitOutOfMemory = 3;  // RESOURCE_EXHAUSTED: a live set did not fit
inline constexpr int kRankExitInvalidJob = 4;   // the job cannot run here (bad data file, ...)

}  // namespace plateau

#endif  // PLATEAU_WORKER_RANK_PROTOCOL_H_
