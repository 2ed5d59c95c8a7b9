#include "server/placement.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "worker/job_spec.h"

namespace plateau {
namespace {

// Whole MiB as "256 MiB"; a size below 1 MiB in bytes, so that a small cap
// is not shown as "0 MiB".
std::string DescribeBytes(int64_t b) {
  if (b % (int64_t{1} << 20) == 0) return absl::StrCat(b >> 20, " MiB");
  if (b < (int64_t{1} << 20)) return absl::StrCat(b, " bytes");
  return absl::StrFormat("%.1f MiB", b / 1048576.0);
}

// Host bytes one rank of the job needs: its cap, or its whole host plan when
// it has none (0: the baseline schedules keep nothing on the host).
int64_t HostNeedPerRank(const v1::Job& job) {
  return job.spec().host_memory_bytes() > 0 ? job.spec().host_memory_bytes() : job.plan().host_total_bytes();
}

}  // namespace

std::string WhyCannotHost(const v1::WorkerCapabilities& caps, int devices, const v1::Job& job,
                          int64_t per_node) {
  const v1::JobSpec& spec = job.spec();
  if (caps.backend() != spec.backend()) return absl::StrCat("backend ", BackendName(caps.backend()));
  if (devices < per_node) return absl::StrCat(devices, " device(s)");
  // A job whose `auto` settings are chosen against this worker's memory
  // (the spec leaves that cap 0) is chosen again when placed (a restart
  // keeps the values it ran with where they fit, else chooses again): its
  // plan's bytes may be from another worker's choice, so the question is
  // whether some value fits here (AutoFitsOnWorker), not whether that plan
  // does.
  const bool rechosen = HasAutoSettings(spec);
  const bool device_rechosen = rechosen && spec.device_memory_bytes() == 0;
  const bool host_rechosen = rechosen && spec.host_memory_bytes() == 0;
  // The job's cap, or its whole plan when it takes the whole card; a worker
  // that does not say its device memory (0) is not refused for it.
  const int64_t need = spec.device_memory_bytes() > 0 ? spec.device_memory_bytes() : job.plan().total_bytes();
  const int64_t memory = caps.device_memory_bytes();
  if (!device_rechosen && memory > 0 && need > memory) return absl::StrCat(DescribeBytes(memory), " per device");
  // Host memory is the node's, shared by the node's ranks (per_node of this
  // job); a worker that does not say its host memory (0) is not refused.
  // need * per_node > host, without the product's overflow.
  const int64_t host_need = HostNeedPerRank(job);
  const int64_t host = caps.host_memory_bytes();
  if (!host_rechosen && host > 0 && host_need > 0 && host_need > host / std::max<int64_t>(per_node, 1)) {
    return absl::StrCat(DescribeBytes(host), " host memory (", per_node, " rank(s) x ", DescribeBytes(host_need),
                        " needed)");
  }
  if ((device_rechosen && memory > 0) || (host_rechosen && host > 0)) {
    if (absl::Status fits = AutoFitsOnWorker(spec, caps, per_node); !fits.ok()) {
      return absl::StrCat(DescribeBytes(memory), " per device and ", DescribeBytes(host),
                          " host memory, where no value of the `auto` settings fits (", fits.message(), ")");
    }
  }
  return "";
}

PlacementDecision Place(const v1::Job& job, const std::vector<WorkerSlots>& workers) {
  const v1::JobSpec& spec = job.spec();
  const int64_t nodes = NodesOf(spec);
  const int64_t per_node = spec.layout().ranks() / nodes;
  std::vector<const WorkerSlots*> fit;
  std::vector<std::string> seen;
  // Workers that could host a node's share when idle, and why each of the
  // others never could.
  std::vector<std::string> hosts, never;
  for (const WorkerSlots& w : workers) {
    seen.push_back(absl::StrCat(w.id, " (", BackendName(w.caps.backend()), ", ", w.free_devices, "/",
                                w.caps.devices(), " free, ", DescribeBytes(w.caps.device_memory_bytes()),
                                " each)"));
    const std::string why = WhyCannotHost(w.caps, w.caps.devices(), job, per_node);
    if (!why.empty()) {
      never.push_back(absl::StrCat(w.id, " has ", why));
      continue;
    }
    hosts.push_back(w.id);
    if (WhyCannotHost(w.caps, w.free_devices, job, per_node).empty()) fit.push_back(&w);
  }
  PlacementDecision d;
  d.waiting_reason = absl::StrCat(
      "waiting for ", nodes, " worker(s) with backend ", BackendName(spec.backend()), ", ", per_node,
      " free device(s) and ", DescribeBytes(spec.device_memory_bytes()), " per device; ",
      seen.empty() ? std::string("no worker is registered") : absl::StrCat("workers: ", absl::StrJoin(seen, ", ")));
  if (static_cast<int64_t>(hosts.size()) < nodes) {
    const std::string memory = spec.device_memory_bytes() > 0
                                   ? DescribeBytes(spec.device_memory_bytes())
                                   : absl::StrCat(DescribeBytes(job.plan().total_bytes()), " (its plan)");
    // Host memory only when the job needs some: nothing to say otherwise.
    const int64_t host_need = HostNeedPerRank(job);
    const std::string host =
        host_need == 0 ? ""
                       : absl::StrCat(", and ", DescribeBytes(host_need),
                                      spec.host_memory_bytes() > 0 ? "" : " (its host plan)",
                                      " host memory per rank");
    d.kind = PlacementDecision::Kind::kUnschedulable;
    d.reason = absl::StrCat(
        "needs ", nodes, " worker(s) with backend ", BackendName(spec.backend()), ", ", per_node,
        " device(s) and ", memory, " per device", host, "; ",
        seen.empty()    ? std::string("no worker is registered")
        : hosts.empty() ? std::string("no registered worker can host it")
                        : absl::StrCat("only ", hosts.size(), " registered worker(s) can host it (",
                                       absl::StrJoin(hosts, ", "), ")"),
        never.empty() ? "" : absl::StrCat("; ", absl::StrJoin(never, ", ")));
    return d;
  }
  if (static_cast<int64_t>(fit.size()) < nodes) {
    d.kind = PlacementDecision::Kind::kWaiting;
    d.reason = d.waiting_reason;
    return d;
  }
  std::stable_sort(fit.begin(), fit.end(), [](const WorkerSlots* x, const WorkerSlots* y) {
    return x->free_devices > y->free_devices;
  });
  d.kind = PlacementDecision::Kind::kPlaced;
  for (int64_t n = 0; n < nodes; ++n) d.nodes.push_back(fit[n]->id);
  return d;
}

}  // namespace plateau
