// What the coordinator's row streams (WatchJob, GetJobLogs) say beyond
// their rows. The handler sends its initial metadata with
// kStreamOpenMetadata once it has admitted the stream and found the job:
// a client then knows the stream is open although no row may come for a
// long time (a pending job, an idle job's logs), and that a later break is
// a coordinator gone away, not one never reached.
#ifndef PLATEAU_PROTO_STREAMS_H_
#define PLATEAU_PROTO_STREAMS_H_

namespace plateau {

inline constexpr char kStreamOpenMetadata[] = "plateau-stream-open";

}  // namespace plateau

#endif  // PLATEAU_PROTO_STREAMS_H_
