// Test hosts of their own for the multi-node tests: network namespaces, one
// per worker agent, each with its own IPv4 address on a bridge, and a link
// from the bridge to this test's network namespace, where the coordinator
// listens on an address of that link. Traffic flows only between these
// addresses: the hosts have no other route.
//
//   test's namespace: veth "pl<pid><rand>"  10.A.B.1/24   (coordinator, client)
//        |
//   hub namespace:    bridge br0 -- up0, h0, h1, ...
//        |                             |   |
//   host i namespace:                eth0 10.A.B.(10+i)/24 (agent i and its ranks)
//
// Each namespace is held by a child process of the test (fork, unshare
// CLONE_NEWNET, wait), never by a name under /var/run/netns that another
// test or a Bazel sandbox could share or forbid; the child dies with the
// test (PR_SET_PDEATHSIG), and the kernel then removes the namespaces with
// every link in them, the test-side veth end included: nothing is left
// behind, even when the test crashes. The subnet 10.A.B.0/24 is chosen at
// random among those no route of the test's namespace covers.
//
// Needs CAP_NET_ADMIN (root): Create() says why when it cannot make them, for
// the caller's GTEST_SKIP.
#ifndef PLATEAU_TESTS_NETNS_H_
#define PLATEAU_TESTS_NETNS_H_

#include <sys/types.h>

#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace plateau {
namespace testing_cluster {

class TestNetwork {
 public:
  // `hosts` namespaces; `log_dir` takes the setup commands' output.
  static absl::StatusOr<std::unique_ptr<TestNetwork>> Create(int hosts, const std::string& log_dir);
  ~TestNetwork();
  TestNetwork(const TestNetwork&) = delete;
  TestNetwork& operator=(const TestNetwork&) = delete;

  // The test side's address (the coordinator listens here).
  const std::string& hub_address() const { return hub_address_; }
  const std::string& host_address(int i) const { return hosts_.at(i).address; }
  pid_t host_pid(int i) const { return hosts_.at(i).holder; }
  // `args` run inside host i's namespace (nsenter; the same process, so
  // its pid and process group are the caller's to manage).
  std::vector<std::string> InHost(int i, const std::vector<std::string>& args) const;

  // A partition: host i's link to the bridge goes down (no process is
  // touched; its TCP connections stall). Restore brings it back.
  absl::Status Cut(int i);
  absl::Status Restore(int i);

 private:
  struct Host {
    pid_t holder = 0;
    std::string address;
  };
  TestNetwork() = default;
  // `args` inside the namespace held by `holder` (0: the test's own).
  absl::Status Ip(pid_t holder, const std::vector<std::string>& args);

  std::string log_dir_;
  int commands_ = 0;
  pid_t hub_ = 0;
  std::string hub_address_;
  std::vector<Host> hosts_;
};

}  // namespace testing_cluster
}  // namespace plateau

#endif  // PLATEAU_TESTS_NETNS_H_
