// The operations files under deploy/ against the real service and the real
// tools (tests/cluster.h): Debian's Prometheus scrapes a running job with
// the shipped scrape job, every Grafana panel's query answers through it,
// the dashboard and the alert rules name only metrics the coordinator
// exports, promtool accepts the configuration, systemd accepts the units
// and they keep their sandboxing and limits, and the Kubernetes workloads
// run confined, sized and behind NetworkPolicies. A missing tool fails the
// test (deploy/install-deps.sh installs it): a skipped check would let the
// files rot unseen.
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <regex>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_replace.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "gmock/gmock.h"
#include "google/protobuf/text_format.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/certificates.h"
#include "tests/cluster.h"

namespace plateau {
namespace {

using ::testing::HasSubstr;
using json = nlohmann::json;

using namespace testing_cluster;  // NOLINT: the harness is this file's vocabulary

// Debian's packages, by absolute path: the test environment's PATH is not
// the one an operator has, and these are the binaries the files are for.
constexpr char kPrometheus[] = "/usr/bin/prometheus";
constexpr char kPromtool[] = "/usr/bin/promtool";
constexpr char kSystemdAnalyze[] = "/usr/bin/systemd-analyze";
constexpr char kSystemdSysusers[] = "/usr/bin/systemd-sysusers";
constexpr char kOpenssl[] = "/usr/bin/openssl";

// Runfiles paths of the files under test.
constexpr char kPrometheusYml[] = "deploy/prometheus/prometheus.yml";
constexpr char kRulesYml[] = "deploy/prometheus/plateau.rules.yml";
constexpr char kDashboard[] = "deploy/grafana/plateau.json";
// The target the shipped scrape job names: the coordinator's default
// --metrics_address.
constexpr char kShippedTarget[] = "127.0.0.1:9464";

::testing::AssertionResult Installed(const std::string& path, const std::string& package) {
  if (access(path.c_str(), X_OK) == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << path << " is missing: install Debian's " << package
                                       << " (deploy/install-deps.sh)";
}

std::string UrlEncode(const std::string& s) {
  std::string out;
  for (unsigned char c : s) {
    if (std::isalnum(c) || c == '-' || c == '_' || c == '.' || c == '~') {
      out += static_cast<char>(c);
    } else {
      absl::StrAppend(&out, "%", absl::Hex(c, absl::kZeroPad2));
    }
  }
  return out;
}

// The JSON body of a 200 response of Prometheus's HTTP API, or null.
json ApiGet(const std::string& address, const std::string& path, std::string* error) {
  const std::string resp = HttpGet(address, path);
  const size_t body = resp.find("\r\n\r\n");
  if (!absl::StartsWith(resp, "HTTP/1.0 200") && !absl::StartsWith(resp, "HTTP/1.1 200")) {
    *error = absl::StrCat("GET ", path, ": ", resp.empty() ? "unreachable" : resp.substr(0, 400));
    return nullptr;
  }
  json j = json::parse(resp.substr(body == std::string::npos ? resp.size() : body + 4), nullptr, false);
  if (j.is_discarded() || j.value("status", "") != "success") {
    *error = absl::StrCat("GET ", path, ": not a successful API answer: ", resp.substr(0, 400));
    return nullptr;
  }
  return j;
}

// An instant query's result vector, or null with `error` set.
json Query(const std::string& prom, const std::string& promql, std::string* error) {
  json j = ApiGet(prom, "/api/v1/query?query=" + UrlEncode(promql), error);
  if (j.is_null()) return nullptr;
  if (j["data"].value("resultType", "") != "vector") {
    *error = absl::StrCat(promql, ": expected a vector, got ", j.dump());
    return nullptr;
  }
  return j["data"]["result"];
}

// The value of the only series of an instant query, NaN when there is not
// exactly one.
double QueryOne(const std::string& prom, const std::string& promql) {
  std::string error;
  json r = Query(prom, promql, &error);
  double v = NAN;
  if (r.is_array() && r.size() == 1 && absl::SimpleAtod(r[0]["value"][1].get<std::string>(), &v)) return v;
  return NAN;
}

// Every "expr" string anywhere in the dashboard (panels, rows' panels) and
// the queries of its template variables.
void CollectQueries(const json& j, std::vector<std::string>* exprs, std::vector<std::string>* variables) {
  if (j.is_object()) {
    for (auto it = j.begin(); it != j.end(); ++it) {
      if (it.key() == "expr" && it->is_string()) exprs->push_back(it->get<std::string>());
      if (it.key() == "definition" && it->is_string()) variables->push_back(it->get<std::string>());
      CollectQueries(*it, exprs, variables);
    }
  } else if (j.is_array()) {
    for (const json& e : j) CollectQueries(e, exprs, variables);
  }
}

json ReadJson(const std::string& path) { return json::parse(ReadFile(path), nullptr, false); }

// The alert rules' expressions: plateau.rules.yml writes each on one line
// after "expr:" (checked: at least one is found).
std::vector<std::string> RuleExprs() {
  std::vector<std::string> exprs;
  for (absl::string_view line : absl::StrSplit(ReadFile(kRulesYml), '\n')) {
    line = absl::StripLeadingAsciiWhitespace(line);
    if (absl::ConsumePrefix(&line, "expr:")) exprs.emplace_back(absl::StripAsciiWhitespace(line));
  }
  return exprs;
}

// Metric names in a PromQL expression: Plateau's names all start with
// "plateau_", and label names and functions never do. `up` is Prometheus's
// own series per target.
std::set<std::string> MetricNames(const std::string& expr) {
  std::set<std::string> names;
  static const std::regex kName("\\bplateau_[a-zA-Z0-9_]+");
  for (auto it = std::sregex_iterator(expr.begin(), expr.end(), kName); it != std::sregex_iterator(); ++it) {
    names.insert(it->str());
  }
  if (std::regex_search(expr, std::regex("(^|[^a-zA-Z0-9_])up\\{"))) names.insert("up");
  return names;
}

// Names of the samples in a /metrics exposition (histograms contribute
// their _bucket, _sum and _count series).
std::set<std::string> ExportedNames(const std::string& scrape) {
  std::set<std::string> names;
  for (absl::string_view line : absl::StrSplit(scrape, '\n')) {
    if (line.empty() || line[0] == '#' || !absl::StartsWith(line, "plateau_")) continue;
    names.insert(std::string(line.substr(0, line.find_first_of("{ "))));
  }
  return names;
}

// What Grafana does to an expression before it reaches Prometheus, for the
// variables the dashboard uses: the training job selected as `job_id`, and a
// rate window that holds several of the test's 1 s scrapes. A job's id, not
// ".+": a panel that selected it by another label would then answer nothing.
std::string AsGrafanaSends(std::string expr, const std::string& job_id) {
  for (const auto& [var, value] : std::vector<std::pair<std::string, std::string>>{
           {"${job_id}", job_id}, {"$job_id", job_id}, {"$__rate_interval", "1m"}}) {
    for (size_t at; (at = expr.find(var)) != std::string::npos;) expr.replace(at, var.size(), value);
  }
  return expr;
}

// The shipped prometheus.yml with only the target and the intervals
// changed: everything else (the scrape job's name and labels, the rule
// file) is under test.
::testing::AssertionResult WriteTestConfig(const std::string& dir, const std::string& target) {
  std::string yml = ReadFile(kPrometheusYml);
  if (!absl::StrContains(yml, kShippedTarget)) {
    return ::testing::AssertionFailure() << kPrometheusYml << " no longer names the target " << kShippedTarget
                                         << "; update this test with it";
  }
  yml = absl::StrReplaceAll(yml, {{kShippedTarget, target}});
  static const std::regex kInterval("(scrape_interval|evaluation_interval): *[0-9a-z]+");
  if (!std::regex_search(yml, kInterval)) return ::testing::AssertionFailure() << "no interval to shorten";
  yml = std::regex_replace(yml, kInterval, "$1: 1s");
  std::ofstream(dir + "/prometheus.yml") << yml;
  std::filesystem::copy_file(kRulesYml, dir + "/plateau.rules.yml");
  return ::testing::AssertionSuccess();
}

TEST(DeployTest, PromtoolAcceptsTheScrapeConfigAndItsRules) {
  ASSERT_TRUE(Installed(kPromtool, "prometheus"));
  const std::string dir = TempDir("promtool");
  Ran r = RunCommand({kPromtool, "check", "config", kPrometheusYml}, dir + "/config");
  EXPECT_EQ(r.code, 0) << r.out << r.err;
  EXPECT_THAT(r.out, HasSubstr("is valid prometheus config file syntax")) << r.out << r.err;
  // The config names the rule file, so the check above also read it; check
  // it by itself too so that a failure says which file.
  r = RunCommand({kPromtool, "check", "rules", kRulesYml}, dir + "/rules");
  EXPECT_EQ(r.code, 0) << r.out << r.err;
  EXPECT_THAT(r.out, HasSubstr("SUCCESS: 7 rules found")) << r.out << r.err;
  // Each alert firing, and staying silent, where its comment says
  // (plateau.rules.test.yml; promtool resolves rule_files beside it).
  r = RunCommand({kPromtool, "test", "rules", "deploy/prometheus/plateau.rules.test.yml"}, dir + "/unit");
  EXPECT_EQ(r.code, 0) << r.out << r.err;
  EXPECT_THAT(r.out, HasSubstr("SUCCESS")) << r.out << r.err;
}

TEST(DeployTest, SystemdAcceptsTheUnitsAndTheSysusersFile) {
  ASSERT_TRUE(Installed(kSystemdAnalyze, "systemd"));
  ASSERT_TRUE(Installed(kSystemdSysusers, "systemd"));
  // An image of the installed system: the units where an operator puts
  // them, the binaries they run (verify checks ExecStart is executable),
  // and the distribution's units they order against (sysinit.target, ...).
  const std::string dir = TempDir("systemd");
  const std::string root = dir + "/root";
  std::filesystem::create_directories(root + "/usr/local/bin");
  std::filesystem::create_directories(root + "/etc/systemd/system");
  std::filesystem::create_directories(root + "/usr/lib/systemd");
  const std::string system_units =
      std::filesystem::exists("/usr/lib/systemd/system/sysinit.target") ? "/usr/lib/systemd/system" : "/lib/systemd/system";
  std::error_code ec;
  // copy_symlinks: masked units are links to /dev/null.
  std::filesystem::copy(system_units, root + "/usr/lib/systemd/system",
                        std::filesystem::copy_options::recursive | std::filesystem::copy_options::copy_symlinks, ec);
  ASSERT_FALSE(ec) << "copying " << system_units << ": " << ec.message();
  for (const char* bin : {"server/plateau_coordinator", "worker/plateau_worker", "worker/plateau_rank"}) {
    std::filesystem::copy_file(bin, root + "/usr/local/bin/" + std::filesystem::path(bin).filename().string());
  }
  for (const char* unit : {"plateau-coordinator.service", "plateau-worker.service"}) {
    std::filesystem::copy_file(absl::StrCat("deploy/systemd/", unit), root + "/etc/systemd/system/" + unit);
    // Secure by default: the token on every call, whatever the env file's
    // --listen (deploy/README.md).
    EXPECT_TRUE(std::regex_search(ReadFile(absl::StrCat("deploy/systemd/", unit)),
                                  std::regex("\nExecStart=[^\n]* --token_file=/etc/plateau/token ")))
        << unit << " does not pass --token_file=/etc/plateau/token";
  }
  Ran r = RunCommand({kSystemdAnalyze, "verify", "--root=" + root, "plateau-coordinator.service", "plateau-worker.service"},
                     dir + "/verify");
  EXPECT_EQ(r.code, 0) << r.out << r.err;
  // Unknown or misspelt settings are only warnings ("Unknown key ...,
  // ignoring"): a unit with any is wrong here.
  EXPECT_EQ(r.err, "") << "systemd-analyze verify warned";

  // Where an operator installs it, named by an absolute path: sysusers
  // cannot open relative ones here, and only warns (exit 0) when it cannot.
  std::filesystem::create_directories(root + "/etc/sysusers.d");
  const std::string sysusers = std::filesystem::absolute(root + "/etc/sysusers.d/plateau.conf");
  std::filesystem::copy_file("deploy/systemd/plateau.sysusers.conf", sysusers);
  r = RunCommand({kSystemdSysusers, "--root=" + root, "--dry-run", sysusers}, dir + "/sysusers");
  EXPECT_EQ(r.code, 0) << r.out << r.err;
  EXPECT_THAT(r.out + r.err, HasSubstr("Creating user 'plateau'"));
}

// A unit file's [Service] settings: every value of each key in file order
// (a key given twice, such as SystemCallFilter=, keeps both), and for each
// key the comment lines right above its first line.
struct UnitSettings {
  std::map<std::string, std::vector<std::string>> values;
  std::map<std::string, std::string> comments;
  std::string Get(const std::string& key) const {
    auto it = values.find(key);
    return it == values.end() || it->second.empty() ? "<unset>" : it->second.back();
  }
};

UnitSettings ServiceSettings(const std::string& path) {
  UnitSettings u;
  bool in_service = false;
  std::string comment;
  for (absl::string_view line : absl::StrSplit(ReadFile(path), '\n')) {
    if (absl::StartsWith(line, "[")) in_service = line == "[Service]";
    if (!in_service) continue;
    if (absl::ConsumePrefix(&line, "#")) {
      absl::StrAppend(&comment, line, "\n");
      continue;
    }
    const size_t eq = line.find('=');
    if (eq != absl::string_view::npos) {
      const std::string key(line.substr(0, eq));
      if (!u.comments.count(key)) u.comments[key] = comment;
      u.values[key].emplace_back(line.substr(eq + 1));
    }
    comment.clear();
  }
  return u;
}

// The sandboxing both units keep (systemd.exec(5)), and the limits of the
// worker, whose ranks share its cgroup: a memory cap, a task cap, and an
// OOM policy that lets the agent report a rank the cap killed. Only what
// `verify` cannot say: it accepts a unit with none of these.
TEST(DeployTest, SystemdUnitsAreSandboxedAndTheWorkerIsCapped) {
  const std::map<std::string, std::string> both = {
      {"NoNewPrivileges", "yes"}, {"CapabilityBoundingSet", ""}, {"AmbientCapabilities", ""},
      {"ProtectSystem", "strict"}, {"PrivateTmp", "yes"}, {"PrivateMounts", "yes"},
      {"ProtectKernelTunables", "yes"}, {"ProtectKernelModules", "yes"}, {"ProtectKernelLogs", "yes"},
      {"ProtectControlGroups", "yes"}, {"ProtectClock", "yes"}, {"ProtectHostname", "yes"},
      {"ProtectProc", "invisible"}, {"RestrictNamespaces", "yes"}, {"RestrictRealtime", "yes"},
      {"RestrictSUIDSGID", "yes"}, {"LockPersonality", "yes"}, {"SystemCallArchitectures", "native"},
      {"SystemCallErrorNumber", "EPERM"}, {"UMask", "0027"}};
  for (const char* unit : {"plateau-coordinator.service", "plateau-worker.service"}) {
    SCOPED_TRACE(unit);
    const UnitSettings u = ServiceSettings(absl::StrCat("deploy/systemd/", unit));
    for (const auto& [key, value] : both) EXPECT_EQ(u.Get(key), value) << key;
    EXPECT_THAT(u.Get("ProtectHome"), ::testing::AnyOf("yes", "read-only"));
    EXPECT_NE(u.Get("SystemCallFilter"), "<unset>");
    // Sockets: the API, the ranks' collectives and local ones; never raw
    // packets.
    const std::string families = u.Get("RestrictAddressFamilies");
    EXPECT_THAT(families, HasSubstr("AF_INET AF_INET6"));
    EXPECT_THAT(families, ::testing::Not(HasSubstr("AF_PACKET")));
    // Under ProtectSystem=strict the state directory is the one writable
    // place (besides /tmp): the daemon's own directory must lie in it.
    const std::string state = u.Get("StateDirectory");
    ASSERT_NE(state, "<unset>");
    EXPECT_THAT(u.Get("ExecStart"), ::testing::ContainsRegex("--(state|work)_dir=%S/" + state + "( |/)"));
  }
  const UnitSettings c = ServiceSettings("deploy/systemd/plateau-coordinator.service");
  EXPECT_EQ(c.Get("PrivateDevices"), "yes");
  EXPECT_EQ(c.Get("MemoryDenyWriteExecute"), "yes");
  UnitSettings w = ServiceSettings("deploy/systemd/plateau-worker.service");
  for (const char* key : {"MemoryMax", "TasksMax"}) {
    EXPECT_THAT(w.Get(key), ::testing::Not(::testing::AnyOf("<unset>", "", "infinity"))) << key;
    EXPECT_NE(w.comments[key], "") << key << " without a comment on sizing it";
  }
  EXPECT_THAT(w.comments["MemoryMax"], HasSubstr("--host_memory_bytes"));
  EXPECT_EQ(w.Get("OOMPolicy"), "continue") << "a rank killed at MemoryMax would stop the agent and every rank";
  // Unlimited locked memory only with the reason it is needed.
  if (w.Get("LimitMEMLOCK") == "infinity") {
    EXPECT_THAT(w.comments["LimitMEMLOCK"], HasSubstr("InfiniBand"));
    EXPECT_THAT(w.comments["LimitMEMLOCK"], HasSubstr("cudaHostAlloc"));
  }
}

// The sbatch script's own logic on this machine: its coordinator, one
// worker through a stand-in srun that drops Slurm's options and runs the
// command (one node), plateauctl submitting a job to the end, and the
// script's cleanup. Slurm itself is not here (deploy/README.md). The
// stand-in srun first calls the coordinator the way a stranger would,
// without the token (while the coordinator is up, before any worker), and
// leaves plateauctl's answer and exit code in dir/untokened. A stand-in
// `hostname` names this machine kUnresolvableHost (options such as -I go to
// the real one): the script must not use the machine's name as an address,
// and no test may depend on what the machine is called. The coordinator's
// ports are 0 (any free one), read back from its ready file.
constexpr char kUnresolvableHost[] = "plateau-test-host.invalid";

struct SbatchRun {
  std::string dir;
  std::string metrics_port;  // the coordinator's, from its ready file
  Ran ran;
};

// Runs the script in `dir` (a TempDir) with the test's Slurm and Plateau
// settings and `extra_env` ("NAME=value") after them.
SbatchRun RunSbatch(const std::string& dir, const std::vector<std::string>& extra_env) {
  SbatchRun run;
  run.dir = dir;
  std::filesystem::create_directories(dir + "/bin");
  std::filesystem::create_directories(dir + "/fakebin");
  // PLATEAU_BIN holds the three binaries side by side, as an install does;
  // the worker finds plateau_rank beside the binary the link resolves to.
  for (const char* bin : {"server/plateau_coordinator", "worker/plateau_worker", "client/plateauctl"}) {
    std::filesystem::create_symlink(std::filesystem::absolute(bin),
                                    dir + "/bin/" + std::filesystem::path(bin).filename().string());
  }
  std::ofstream(dir + "/fakebin/srun")
      << "#!/bin/bash\n"
      << "env -u PLATEAU_TOKEN_FILE \"$PLATEAU_BIN/plateauctl\" --coordinator=\"$PLATEAU_COORDINATOR\" list >"
      << dir << "/untokened 2>&1\n"
      << "echo \"exit $?\" >>" << dir << "/untokened\n"
      << "while [[ \"$1\" == --* ]]; do shift; done\nexec \"$@\"\n";
  std::filesystem::permissions(dir + "/fakebin/srun", std::filesystem::perms::owner_all);
  std::ofstream(dir + "/fakebin/hostname") << "#!/bin/bash\n"
                                           << "if [ $# -eq 0 ]; then echo " << kUnresolvableHost << "; exit 0; fi\n"
                                           << "exec /bin/hostname \"$@\"\n";
  std::filesystem::permissions(dir + "/fakebin/hostname", std::filesystem::perms::owner_all);
  std::string spec;
  google::protobuf::TextFormat::PrintToString(TinyJob(4), &spec);
  std::ofstream(dir + "/spec.txtpb") << spec;
  std::vector<std::string> args = {"/usr/bin/env", "PATH=" + dir + "/fakebin:/usr/bin:/bin", "SLURM_JOB_ID=42",
                                   "SLURM_JOB_NUM_NODES=1", "SLURM_CPUS_ON_NODE=2", "TMPDIR=" + dir,
                                   "PLATEAU_BIN=" + dir + "/bin", "PLATEAU_BACKEND=cpu", "PLATEAU_DEVICES=2",
                                   "PLATEAU_RANK_ADDRESS=127.0.0.1", "PLATEAU_RUN_DIR=" + dir + "/run",
                                   "PLATEAU_API_PORT=0", "PLATEAU_METRICS_PORT=0",
                                   "PLATEAU_SPEC=" + dir + "/spec.txtpb"};
  args.insert(args.end(), extra_env.begin(), extra_env.end());
  args.insert(args.end(), {"/bin/bash", "deploy/slurm/plateau.sbatch"});
  run.ran = RunCommand(args, dir + "/sbatch");
  for (absl::string_view line : absl::StrSplit(ReadFile(dir + "/run/coordinator.ready"), '\n')) {
    if (absl::ConsumePrefix(&line, "metrics=")) run.metrics_port = std::string(line.substr(line.rfind(':') + 1));
  }
  return run;
}

// What every run of the script must show: the job to the end, a coordinator
// that refused the call without the token, and the cleanup.
void ExpectSecuredRunToTheEnd(const SbatchRun& run) {
  const Ran& r = run.ran;
  EXPECT_EQ(r.code, 0) << r.out << r.err;
  EXPECT_THAT(r.out, HasSubstr("plateau.sbatch: coordinator at "));
  EXPECT_THAT(r.out + r.err, ::testing::Not(HasSubstr(std::string(kUnresolvableHost) + ":")))
      << "the script used the machine's name as an address";
  EXPECT_THAT(r.out, HasSubstr("summary: job-1 SUCCEEDED")) << r.out << r.err;
  const std::string log = ReadFile(run.dir + "/run/coordinator.log");
  EXPECT_THAT(log, HasSubstr("bearer token required")) << log;
  const std::string untokened = ReadFile(run.dir + "/untokened");
  EXPECT_THAT(untokened, HasSubstr("UNAUTHENTICATED: missing bearer token")) << untokened;
  EXPECT_THAT(untokened, HasSubstr("exit 2")) << untokened;
  // The script stopped the worker (it stops its ranks) and then the
  // coordinator it started: none of its processes is left. (Not "nothing
  // answers on the metrics port": once freed, another test may bind it.)
  EXPECT_THAT(r.out + r.err, HasSubstr("plateau_worker: signal 15, stopping every rank"));
  EXPECT_THAT(log, HasSubstr("shutting down"));
  // Every coordinator line has its time, its start and its signal too
  // (those two had none beside the timed lines of its events).
  {
    const std::regex stamped("^[0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9:.]+Z plateau_coordinator: ");
    int lines = 0;
    for (absl::string_view line : absl::StrSplit(log, '\n', absl::SkipEmpty())) {
      if (!absl::StrContains(line, "plateau_coordinator: ")) continue;
      ++lines;
      EXPECT_TRUE(std::regex_search(std::string(line), stamped)) << line;
    }
    EXPECT_GE(lines, 2) << log;
  }
  ASSERT_FALSE(run.metrics_port.empty()) << "no metrics= in the coordinator's ready file";
  EXPECT_THAT(ProcessesUnder(run.dir), ::testing::IsEmpty()) << "the script left processes running";
}

// Without PLATEAU_TOKEN_FILE the script makes a token only this user can
// read, in the run directory, and gives its path (never the token) to the
// coordinator, the worker and plateauctl. Without PLATEAU_COORDINATOR_HOST
// it advertises the coordinator at an IP address of this node.
TEST(DeployTest, SlurmScriptRunsAJobThroughAStandInSrunWithAGeneratedToken) {
  const SbatchRun run = RunSbatch(TempDir("slurm"), {});
  ExpectSecuredRunToTheEnd(run);
  EXPECT_TRUE(std::regex_search(run.ran.out, std::regex("coordinator at (\\d+\\.\\d+\\.\\d+\\.\\d+|\\[[0-9a-fA-F:]+\\]):\\d+ ")))
      << run.ran.out;
  const std::string token_file = run.dir + "/run/token";
  EXPECT_THAT(run.ran.out, HasSubstr("(bearer token in " + token_file + ")"));
  ASSERT_TRUE(std::filesystem::exists(token_file));
  EXPECT_EQ(std::filesystem::status(token_file).permissions(),
            std::filesystem::perms::owner_read | std::filesystem::perms::owner_write);
  const std::string token = ReadFile(token_file);
  EXPECT_TRUE(std::regex_match(token, std::regex("[0-9a-f]{64}"))) << "'" << token << "'";
  // The stand-in srun leaves the worker's output in the script's.
  const std::string logs = run.ran.out + run.ran.err + ReadFile(run.dir + "/run/coordinator.log");
  EXPECT_FALSE(absl::StrContains(logs, token)) << "the token is in a log";
}

// PLATEAU_TOKEN_FILE is used as given (with a warning, as other users may
// read it), and the TLS files serve the coordinator; the clients verify it
// with the certificate as their CA (self-signed, naming the address given in
// PLATEAU_COORDINATOR_HOST, which the script gives them as the
// coordinator's).
TEST(DeployTest, SlurmScriptUsesTheGivenTokenAndTls) {
  ASSERT_TRUE(Installed(kOpenssl, "openssl"));
  const std::string dir = TempDir("slurm_tls");
  const std::string token_file = dir + "/given-token";
  std::ofstream(token_file) << "given-Token_7\n";
  std::filesystem::permissions(token_file, std::filesystem::perms::owner_read | std::filesystem::perms::owner_write |
                                               std::filesystem::perms::group_read);
  Ran r = RunCommand({kOpenssl, "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
                      "-keyout", dir + "/key.pem", "-out", dir + "/cert.pem", "-days", "2", "-subj", "/CN=plateau-test",
                      "-addext", "subjectAltName=IP:127.0.0.1"},
                     dir + "/openssl");
  ASSERT_EQ(r.code, 0) << r.err;

  const SbatchRun run = RunSbatch(dir, {"PLATEAU_TOKEN_FILE=" + token_file, "PLATEAU_TLS_CERT_FILE=" + dir + "/cert.pem",
                                        "PLATEAU_TLS_KEY_FILE=" + dir + "/key.pem", "PLATEAU_COORDINATOR_HOST=127.0.0.1"});
  ExpectSecuredRunToTheEnd(run);
  EXPECT_THAT(run.ran.out, HasSubstr("coordinator at 127.0.0.1:"));
  EXPECT_THAT(run.ran.out, HasSubstr("(bearer token in " + token_file + ", TLS)"));
  EXPECT_THAT(run.ran.err, HasSubstr("PLATEAU_TOKEN_FILE=" + token_file + " has mode 640; chmod 600 it"));
  EXPECT_THAT(ReadFile(dir + "/run/coordinator.log"), HasSubstr("(TLS, bearer token required)"));
  EXPECT_FALSE(std::filesystem::exists(dir + "/run/token")) << "a token was generated although one was given";
}

// The script's nodes lent to an existing coordinator (PLATEAU_COORDINATOR)
// that requires client certificates: the worker and its ranks present
// PLATEAU_TLS_CLIENT_CERT_FILE, and so does plateauctl, so the job runs to
// the end; half a certificate, or one without the CA, stops the script
// before anything starts.
TEST(DeployTest, SlurmScriptPresentsTheClientCertificateToAnExistingCoordinator) {
  const std::string dir = TempDir("slurm_mtls");
  testing_certificates::MutualTls m;
  ASSERT_TRUE(testing_certificates::MakeMutualTls(dir, "IP:127.0.0.1", "slurm-node", &m));
  const testing_certificates::Pem &server = m.server, &client_ca = m.client_ca, &client = m.client;
  const std::string ready = dir + "/coordinator.ready";
  Process coordinator({"server/plateau_coordinator", "--state_dir=" + dir + "/state", "--listen=127.0.0.1:0",
                       "--metrics_address=127.0.0.1:0", "--ready_file=" + ready, "--tls_cert_file=" + server.cert,
                       "--tls_key_file=" + server.key, "--tls_client_ca_file=" + client_ca.cert},
                      dir + "/coordinator");
  ASSERT_TRUE(WaitFor([&] { return std::filesystem::exists(ready) || !coordinator.Running(); })) << coordinator.err();
  std::string api;
  for (absl::string_view line : absl::StrSplit(ReadFile(ready), '\n')) {
    if (absl::ConsumePrefix(&line, "api=")) api = std::string(line);
  }
  ASSERT_FALSE(api.empty()) << coordinator.err();

  const std::vector<std::string> tls = {"PLATEAU_COORDINATOR=" + api, "PLATEAU_TLS_CA_FILE=" + server.cert,
                                        "PLATEAU_TLS_CLIENT_CERT_FILE=" + client.cert,
                                        "PLATEAU_TLS_CLIENT_KEY_FILE=" + client.key};
  const SbatchRun run = RunSbatch(dir + "/run-ok", tls);
  EXPECT_EQ(run.ran.code, 0) << run.ran.out << run.ran.err << coordinator.err();
  EXPECT_THAT(run.ran.out, HasSubstr("summary: job-1 SUCCEEDED"));
  EXPECT_THAT(coordinator.out(), HasSubstr("job-1 submitted by CN=slurm-node at 127.0.0.1"));

  const SbatchRun half = RunSbatch(dir + "/run-half", {tls[0], tls[1], tls[2]});
  EXPECT_NE(half.ran.code, 0);
  EXPECT_THAT(half.ran.err, HasSubstr("a client certificate needs both PLATEAU_TLS_CLIENT_CERT_FILE and "
                                      "PLATEAU_TLS_CLIENT_KEY_FILE"));
  const SbatchRun no_ca = RunSbatch(dir + "/run-noca", {tls[0], tls[2], tls[3]});
  EXPECT_NE(no_ca.ran.code, 0);
  EXPECT_THAT(no_ca.ran.err, HasSubstr("PLATEAU_TLS_CLIENT_CERT_FILE is sent only over TLS"));
  for (const SbatchRun* r : {&half, &no_ca}) {
    EXPECT_FALSE(std::filesystem::exists(r->dir + "/untokened")) << "srun ran";
  }
}

// The default of `--NAME` as the binary's --help prints it ("  --NAME=VALUE
// help"), or "" when it prints none.
std::string HelpDefault(const std::string& help, const std::string& name) {
  std::smatch m;
  if (!std::regex_search(help, m, std::regex("\\n  --" + name + "=(\\S+)"))) return "";
  return m[1];
}

// The figures the operations docs quote for the binaries' defaults are the
// ones the built binaries' --help prints (issue 16: the docs had drifted).
TEST(DeployTest, DocumentedDefaultsMatchTheBinariesHelp) {
  const std::string dir = TempDir("defaults");
  Ran c = RunCommand({"server/plateau_coordinator", "--help"}, dir + "/coordinator-help");
  Ran w = RunCommand({"worker/plateau_worker", "--help"}, dir + "/worker-help");
  const std::string chelp = c.out + c.err, whelp = w.out + w.err;
  const std::string heartbeat_ms = HelpDefault(chelp, "heartbeat_ms");
  const std::string worker_timeout = HelpDefault(chelp, "worker_timeout_s");
  const std::string retention = HelpDefault(chelp, "metrics_retention_s");
  const std::string reattach = HelpDefault(chelp, "reattach_timeout_s");
  const std::string grace = HelpDefault(whelp, "grace_s");
  ASSERT_FALSE(heartbeat_ms.empty() || worker_timeout.empty() || retention.empty() || reattach.empty() ||
               grace.empty())
      << chelp << whelp;
  int64_t ms = 0;
  ASSERT_TRUE(absl::SimpleAtoi(heartbeat_ms, &ms));
  // 0 is "two heartbeat intervals", which is what the docs say.
  ASSERT_EQ(worker_timeout, "0");
  EXPECT_THAT(chelp, HasSubstr("(0: two heartbeat intervals)"));

  const std::string rules = ReadFile(kRulesYml);
  EXPECT_THAT(rules, HasSubstr(absl::StrCat("--heartbeat_ms (", ms / 1000, " s by default")));
  EXPECT_THAT(rules, HasSubstr("--worker_timeout_s (two heartbeat intervals by default"));
  const std::string dashboard = ReadFile(kDashboard);
  EXPECT_THAT(dashboard, HasSubstr(absl::StrCat("--heartbeat_ms (", ms, " ms by default")));
  EXPECT_THAT(dashboard, HasSubstr("--worker_timeout_s (two heartbeat intervals by default"));
  const std::string readme = ReadFile("deploy/README.md");
  EXPECT_THAT(readme, HasSubstr(absl::StrCat("`--metrics_retention_s` (", retention, " s)")));
  EXPECT_THAT(readme, HasSubstr(absl::StrCat("`--reattach_timeout_s` (", reattach, " s)")));
  EXPECT_THAT(readme, HasSubstr(absl::StrCat("`--grace_s` (", grace, " s)")));
  EXPECT_THAT(readme, HasSubstr(absl::StrCat("2 s at its ", ms, " ms")));
  // A restarted coordinator re-attaches its jobs (docs/SERVICE.md "Faults").
  EXPECT_THAT(readme, ::testing::Not(::testing::ContainsRegex("restarted coordinator marks[^.]*FAILED")));
}

TEST(DeployTest, DashboardAndAlertsNameOnlyMetricsTheCoordinatorExports) {
  json dash = ReadJson(kDashboard);
  ASSERT_FALSE(dash.is_discarded()) << kDashboard << " is not JSON";
  std::vector<std::string> exprs, variables;
  CollectQueries(dash, &exprs, &variables);
  ASSERT_GE(exprs.size(), 10u) << "the dashboard's queries were not found";
  ASSERT_FALSE(variables.empty()) << "the $job_id variable's query was not found";
  const std::vector<std::string> rules = RuleExprs();
  ASSERT_EQ(rules.size(), 7u) << "the alert rules' expressions were not found";

  Cluster c("names");
  ASSERT_TRUE(c.ready()) << c.Logs();
  // With a validation loss, so that its series is in the scrape too.
  v1::JobSpec spec = TinyJob(3);
  spec.set_validation_every(3);
  spec.mutable_data()->set_held_out_sequences(4);
  auto sub = c.client().SubmitJob(spec, false);
  ASSERT_TRUE(sub.ok()) << sub.status();
  ASSERT_EQ(c.WaitDone(sub->job().id()).state(), v1::SUCCEEDED) << c.Logs();
  const std::string scrape = Scrape(c.metrics());
  ASSERT_THAT(scrape, HasSubstr("200 OK"));
  std::set<std::string> exported = ExportedNames(scrape);
  ASSERT_TRUE(exported.count("plateau_job_loss")) << scrape;
  exported.insert("up");

  std::vector<std::string> all = exprs;
  all.insert(all.end(), variables.begin(), variables.end());
  all.insert(all.end(), rules.begin(), rules.end());
  for (const std::string& e : all) {
    const std::set<std::string> names = MetricNames(e);
    // A misspelt prefix ("plateu_") would leave a query naming nothing.
    EXPECT_FALSE(names.empty()) << "names no Plateau metric: " << e;
    for (const std::string& n : names) {
      EXPECT_TRUE(exported.count(n)) << n << " (in " << e << ") is not in a real /metrics scrape; exported: "
                                     << absl::StrJoin(exported, " ");
    }
  }
  // The operator's panels: workers, slots, queue, and the plan drawn over
  // the peak per live set; each queries a series of that real scrape.
  const std::vector<std::pair<std::string, std::string>> panels = {
      {"Workers", "plateau_workers"},
      {"Workers", "plateau_workers_lost_total"},
      {"Slots", "plateau_slots_total"},
      {"Slots", "plateau_slots_free"},
      {"Queue", "plateau_queue_length"},
      {"Model TFLOP/s", "plateau_job_tflops"},
      {"Model TFLOP/s", "plateau_job_model_flops_total"},
      {"Peak device bytes per live set, against the plan", "plateau_job_peak_bytes"},
      {"Peak device bytes per live set, against the plan", "plateau_job_planned_bytes"},
      {"Peak host bytes per live set, against the plan", "plateau_job_host_peak_bytes"},
      {"Peak host bytes per live set, against the plan", "plateau_job_host_planned_bytes"},
      {"Device bytes: the budget's total against the device's own view", "plateau_job_device_used_bytes"},
      {"Device bytes: the budget's total against the device's own view", "plateau_job_device_pool_reserved_bytes"}};
  for (const auto& [title, metric] : panels) {
    bool found = false;
    for (const json& panel : dash["panels"]) {
      if (panel.value("title", "") != title) continue;
      std::vector<std::string> panel_exprs, unused;
      CollectQueries(panel, &panel_exprs, &unused);
      for (const std::string& e : panel_exprs) found = found || MetricNames(e).count(metric) > 0;
    }
    EXPECT_TRUE(found) << "no panel '" << title << "' queries " << metric;
    EXPECT_TRUE(exported.count(metric)) << metric << " is not in a real /metrics scrape";
  }
}

// A job's counters grow once a step, and a long-context step takes
// minutes: a rate() or increase() of them over a window shorter than one
// step holds one step's increment or none, and the panel saw-tooths. Each
// panel that rates them has a min interval of at least 5 min (Grafana's
// $__rate_interval is then at least that), and says in its description
// which time its figures divide by.
TEST(DeployTest, DashboardRatesAJobsCountersOverAtLeastFiveMinutes) {
  json dash = ReadJson(kDashboard);
  ASSERT_FALSE(dash.is_discarded()) << kDashboard << " is not JSON";
  static const std::regex kRated("(rate|increase)\\(plateau_job_");
  static const std::regex kWindow("\\[([^\\]]*)\\]");
  int rated = 0;
  for (const json& panel : dash["panels"]) {
    std::vector<std::string> exprs, unused;
    CollectQueries(panel, &exprs, &unused);
    for (const std::string& e : exprs) {
      if (!std::regex_search(e, kRated)) continue;
      ++rated;
      for (auto it = std::sregex_iterator(e.begin(), e.end(), kWindow); it != std::sregex_iterator(); ++it) {
        EXPECT_EQ((*it)[1].str(), "$__rate_interval") << panel["title"] << ": a fixed window in " << e;
      }
      const std::string interval = panel.value("interval", "");
      std::smatch m;
      ASSERT_TRUE(std::regex_match(interval, m, std::regex("([0-9]+)([smh])")))
          << panel["title"] << " rates a job's counter without a min interval: " << e;
      const int seconds = std::stoi(m[1]) * (m[2] == "s" ? 1 : m[2] == "m" ? 60 : 3600);
      EXPECT_GE(seconds, 300) << panel["title"] << "'s min interval " << interval;
      const std::string description = panel.value("description", "");
      EXPECT_THAT(description, HasSubstr("validation and checkpoint writes")) << panel["title"];
    }
  }
  EXPECT_GE(rated, 4) << "the throughput and step-time panels' rates were not found";
}

TEST(DeployTest, RealPrometheusScrapesTheRunningJobAndAnswersEveryPanel) {
  ASSERT_TRUE(Installed(kPrometheus, "prometheus"));
  Cluster c("prometheus");
  ASSERT_TRUE(c.ready()) << c.Logs();
  ASSERT_TRUE(WriteTestConfig(c.dir(), c.metrics()));
  // Prometheus cannot report a port it picked: a free port, and another if
  // some other process took it first (Prometheus then exits). Ready only
  // while our Prometheus runs, so a server of another test on that port
  // cannot pass for it.
  std::string prom;
  std::unique_ptr<Process> prometheus_process;
  for (int attempt = 0; attempt < 5; ++attempt) {
    prom = absl::StrCat("127.0.0.1:", FreePort());
    prometheus_process = std::make_unique<Process>(
        std::vector<std::string>{kPrometheus, "--config.file=" + c.dir() + "/prometheus.yml",
                                 "--storage.tsdb.path=" + c.dir() + "/tsdb", "--web.listen-address=" + prom},
        absl::StrCat(c.dir(), "/prometheus-", attempt));
    WaitFor([&] {
      return !prometheus_process->Running() || absl::StrContains(HttpGet(prom, "/-/ready"), " 200 ");
    });
    if (prometheus_process->Running() || !absl::StrContains(prometheus_process->err(), "address already in use")) break;
  }
  Process& prometheus = *prometheus_process;
  ASSERT_TRUE(prometheus.Running() && absl::StrContains(HttpGet(prom, "/-/ready"), " 200 ")) << prometheus.err();

  // A validation loss every step, so that the loss panel's validation
  // query has a series to answer with.
  v1::JobSpec long_spec = TinyJob(1000000);
  long_spec.set_validation_every(1);
  long_spec.mutable_data()->set_held_out_sequences(4);
  auto sub = c.client().SubmitJob(long_spec, false);
  ASSERT_TRUE(sub.ok()) << sub.status();
  const std::string id = sub->job().id();
  ASSERT_EQ(id, "job-1");

  // While it runs: Prometheus holds a sample of the RUNNING state and of a
  // completed step. Cancelling only afterwards makes these scrapes of a
  // running job (the state never returns to RUNNING).
  const std::string sel = absl::StrCat("{job_id=\"", id, "\",rank=\"0\"}");
  std::string error;
  ASSERT_TRUE(WaitFor([&] {
    return QueryOne(prom, "plateau_job_state{job_id=\"job-1\",state=\"RUNNING\"}") == 1 &&
           QueryOne(prom, "plateau_job_step" + sel) >= 2;
  })) << "Prometheus holds no running sample of job-1; its plateau_job_step series (an id the "
         "scrape job renamed shows as exported_job_id): "
      << Query(prom, "plateau_job_step", &error).dump() << error << "\n"
      << prometheus.err() << c.Logs();
  const double running_loss = QueryOne(prom, "plateau_job_loss" + sel);
  ASSERT_TRUE(c.client().CancelJob(id).ok());
  const v1::Job job = c.WaitDone(id);
  ASSERT_EQ(job.state(), v1::CANCELLED) << c.Logs();

  // That loss is one rank 0 reported. The exposition prints 16 significant
  // digits, so the match is to that precision; consecutive steps' losses
  // differ far more.
  std::vector<double> losses;
  ASSERT_TRUE(c.client().WatchJob(id, 0, [&](const v1::JobEvent& e) {
    for (const v1::StepTelemetry& t : e.job_step().per_rank()) {
      if (t.rank() == 0) losses.push_back(t.loss());
    }
    return true;
  }, /*per_rank=*/true).ok());
  EXPECT_TRUE(std::any_of(losses.begin(), losses.end(), [&](double l) {
    return std::abs(l - running_loss) <= 1e-14 * std::abs(l);
  })) << "Prometheus's loss " << running_loss << " while running is none of rank 0's " << losses.size() << " losses";

  // Once cancelled the gauges stay: Prometheus's next scrapes must give
  // exactly what /metrics shows, which is GetJob's progress (rank 0's).
  const double final_loss = Sample(Scrape(c.metrics()), "plateau_job_loss" + sel);
  ASSERT_GT(final_loss, 0);
  EXPECT_NEAR(final_loss, job.progress().loss(), 1e-14 * final_loss);
  EXPECT_TRUE(WaitFor([&] { return QueryOne(prom, "plateau_job_loss" + sel) == final_loss; }))
      << "Prometheus has " << QueryOne(prom, "plateau_job_loss" + sel) << ", /metrics " << final_loss;
  // The query an operator types: both ranks, selected by the training job's
  // id. Rank 1 may have reported one step more or less than rank 0 when the
  // cancel stopped them. Each series keeps the id as Plateau exported it and
  // carries the scrape job's name, which the "up" alert and panel select.
  json both = Query(prom, "plateau_job_loss{job_id=\"job-1\"}", &error);
  ASSERT_TRUE(both.is_array()) << error;
  ASSERT_EQ(both.size(), 2u) << both.dump();
  for (const json& s : both) {
    EXPECT_EQ(s["metric"].value("job", ""), "plateau-coordinator") << s.dump();
    EXPECT_EQ(s["metric"].value("job_id", ""), "job-1") << s.dump();
    EXPECT_FALSE(s["metric"].contains("exported_job_id")) << s.dump();
    double v = 0;
    ASSERT_TRUE(absl::SimpleAtod(s["value"][1].get<std::string>(), &v)) << s.dump();
    EXPECT_GT(v, 0) << s.dump();
    if (s["metric"].value("rank", "") == "0") {
      EXPECT_EQ(v, final_loss) << s.dump();
    }
  }
  EXPECT_TRUE(WaitFor([&] { return QueryOne(prom, "plateau_job_state{job_id=\"job-1\",state=\"CANCELLED\"}") == 1; }));

  // The job variable offers job-1: its label_values(METRIC, LABEL) is what
  // Grafana asks of Prometheus's label values API.
  std::vector<std::string> exprs, variables;
  CollectQueries(ReadJson(kDashboard), &exprs, &variables);
  ASSERT_FALSE(exprs.empty());
  for (const std::string& v : variables) {
    std::smatch m;
    ASSERT_TRUE(std::regex_match(v, m, std::regex("label_values\\(([a-z_]+), *([a-z_]+)\\)"))) << v;
    json values = ApiGet(prom, absl::StrCat("/api/v1/label/", m[2].str(), "/values?match[]=", UrlEncode(m[1].str())),
                         &error);
    ASSERT_FALSE(values.is_null()) << error;
    EXPECT_EQ(values["data"], json::array({"job-1"})) << v << " offers " << values.dump();
  }

  // Every dashboard query answers with at least one series: a wrong label,
  // a wrong aggregation or a metric that is never set would leave a panel
  // empty.
  for (const std::string& e : exprs) {
    const std::string q = AsGrafanaSends(e, id);
    ASSERT_FALSE(absl::StrContains(q, "$")) << "a Grafana variable this test does not know: " << e;
    json r = Query(prom, q, &error);
    ASSERT_TRUE(r.is_array()) << error;
    EXPECT_FALSE(r.empty()) << "the panel query answers nothing: " << q;
  }

  // A panel's data links, filled in from each series its query answers as
  // Grafana fills ${__field.labels.NAME}, lead to a page the coordinator
  // serves (the memory timeline: job-1 recorded step 1's).
  int links = 0;
  const json dashboard = ReadJson(kDashboard);
  for (const json& panel : dashboard["panels"]) {
    if (!panel.contains("fieldConfig") || !panel["fieldConfig"]["defaults"].contains("links")) continue;
    json series = Query(prom, AsGrafanaSends(panel["targets"][0]["expr"].get<std::string>(), id), &error);
    ASSERT_TRUE(series.is_array() && !series.empty()) << error;
    for (const json& link : panel["fieldConfig"]["defaults"]["links"]) {
      for (const json& one : series) {
        std::string url = link["url"].get<std::string>();
        for (auto it = one["metric"].begin(); it != one["metric"].end(); ++it) {
          url = absl::StrReplaceAll(url, {{absl::StrCat("${__field.labels.", it.key(), "}"), it->get<std::string>()}});
        }
        ASSERT_FALSE(absl::StrContains(url, "${")) << "a label the series lacks: " << url << " " << one.dump();
        absl::string_view rest = url;
        ASSERT_TRUE(absl::ConsumePrefix(&rest, "http://")) << url;
        const size_t slash = rest.find('/');
        ASSERT_NE(slash, absl::string_view::npos) << url;
        const std::string page = HttpGet(std::string(rest.substr(0, slash)), std::string(rest.substr(slash)));
        EXPECT_EQ(HttpStatus(page), 200) << panel["title"] << ": " << url << "\n" << page.substr(0, 300);
        EXPECT_THAT(page, HasSubstr("job-1 memory timeline")) << url;
        ++links;
      }
    }
  }
  EXPECT_GE(links, 2) << "no panel links to the memory timeline page";

  // The alert rules loaded and evaluate without error, and none fires on a
  // healthy cluster whose job kept every live set within its plan.
  ASSERT_TRUE(WaitFor([&] {
    json j = ApiGet(prom, "/api/v1/rules", &error);
    if (j.is_null() || j["data"]["groups"].empty()) return false;
    for (const json& rule : j["data"]["groups"][0]["rules"]) {
      if (rule.value("health", "") != "ok") return false;
    }
    return j["data"]["groups"][0]["rules"].size() == 7;
  })) << ApiGet(prom, "/api/v1/rules", &error).dump() << error;
  json alerts = ApiGet(prom, "/api/v1/alerts", &error);
  ASSERT_FALSE(alerts.is_null()) << error;
  EXPECT_TRUE(alerts["data"]["alerts"].empty()) << alerts.dump();
}

// kubectl where Debian's kubernetes-client (1.20) or another build puts it.
std::string Kubectl() {
  for (const char* p : {"/usr/bin/kubectl", "/usr/local/bin/kubectl", "/snap/bin/kubectl"}) {
    if (access(p, X_OK) == 0) return p;
  }
  return "";
}

// A container's "--name=value" arguments by name.
std::map<std::string, std::string> Flags(const json& container) {
  std::map<std::string, std::string> out;
  for (const json& a : container.at("args")) {
    const std::string arg = a.get<std::string>();
    const size_t eq = arg.find('=');
    if (arg.rfind("--", 0) == 0 && eq != std::string::npos) out[arg.substr(2, eq - 2)] = arg.substr(eq + 1);
  }
  return out;
}

std::string PortOf(const std::string& address) { return address.substr(address.rfind(':') + 1); }

// The container's port named `name`, or -1.
int ContainerPort(const json& container, const std::string& name) {
  for (const json& p : container.at("ports")) {
    if (p.value("name", "") == name) return p.at("containerPort").get<int>();
  }
  return -1;
}

// mountPath of the volume mount `name`, "" when absent.
std::string MountPath(const json& container, const std::string& name) {
  for (const json& m : container.at("volumeMounts")) {
    if (m.at("name") == name) return m.at("mountPath").get<std::string>();
  }
  return "";
}

// The pod spec's volume `name` (null when absent).
json Volume(const json& pod, const std::string& name) {
  for (const json& v : pod.at("volumes")) {
    if (v.at("name") == name) return v;
  }
  return json();
}

// The manifests of deploy/kubernetes (the kustomization aside).
const std::vector<std::string> kManifests = {
    "token-secret.yaml",        "coordinator-pvc.yaml",           "coordinator-deployment.yaml",
    "coordinator-service.yaml", "coordinator-networkpolicy.yaml", "checkpoints-pvc.yaml",
    "worker-daemonset.yaml",    "worker-networkpolicy.yaml"};

// Decodes every manifest into `by_kind` ("KIND/NAME": the object as kubectl
// decoded it), and checks that the kustomization builds them all but the
// Secret.
void DecodeManifests(const std::string& dir, std::map<std::string, json>* by_kind) {
  const std::string kubectl = Kubectl();
  ASSERT_FALSE(kubectl.empty()) << "kubectl is missing: install Debian's kubernetes-client (deploy/install-deps.sh "
                                   "--tests)";
  // Client-side only, on kubectl 1.20 and later alike: `label --local`
  // decodes each file into the typed API objects (a wrong type or a
  // malformed file fails) without a cluster; `create/apply --dry-run=client`
  // would ask a server for the kinds. No kubeconfig, so no cluster is ever
  // contacted.
  const std::string env = "/usr/bin/env";
  const std::string no_config = "KUBECONFIG=" + dir + "/no-kubeconfig";
  for (const std::string& f : kManifests) {
    const std::string path = "deploy/kubernetes/" + f;
    Ran r = RunCommand({env, no_config, kubectl, "label", "--local", "-f", path, "plateau.dev/checked=true", "-o", "json"},
                       dir + "/" + f);
    ASSERT_EQ(r.code, 0) << path << ": " << r.out << r.err;
    json j = json::parse(r.out, nullptr, false);
    ASSERT_FALSE(j.is_discarded()) << r.out;
    EXPECT_EQ(j["metadata"]["labels"]["plateau.dev/checked"], "true") << path;
    (*by_kind)[j.at("kind").get<std::string>() + "/" + j["metadata"]["name"].get<std::string>()] = j;
  }
  // The kustomization lists all but the Secret and builds offline. The
  // README creates the Secret first and then applies the kustomization: a
  // listed placeholder Secret would overwrite the real token. (On a copy:
  // kustomize does not take the runfiles tree's symlinked files.)
  const std::string kustomization = ReadFile("deploy/kubernetes/kustomization.yaml");
  for (const std::string& f : kManifests) {
    if (f == "token-secret.yaml") continue;
    EXPECT_THAT(kustomization, HasSubstr("\n  - " + f + "\n")) << "kustomization.yaml does not list " << f;
  }
  const std::string copy = dir + "/kustomize-copy";
  std::filesystem::create_directories(copy);
  for (const std::string& f : kManifests) std::filesystem::copy_file("deploy/kubernetes/" + f, copy + "/" + f);
  std::filesystem::copy_file("deploy/kubernetes/kustomization.yaml", copy + "/kustomization.yaml");
  Ran k = RunCommand({env, no_config, kubectl, "kustomize", copy}, dir + "/kustomize");
  ASSERT_EQ(k.code, 0) << k.out << k.err;
  for (const auto& [key, obj] : *by_kind) {
    if (obj["kind"] == "Secret") continue;
    EXPECT_THAT(k.out, HasSubstr("name: " + obj["metadata"]["name"].get<std::string>())) << key;
  }
  EXPECT_THAT(k.out, ::testing::Not(HasSubstr("kind: Secret")))
      << "kubectl apply -k would overwrite the token the README creates";
}

TEST(DeployTest, KubernetesManifestsParseAndMatchWhatTheBinariesAccept) {
  const std::string dir = TempDir("kubernetes");
  std::map<std::string, json> by_kind;
  ASSERT_NO_FATAL_FAILURE(DecodeManifests(dir, &by_kind));

  ASSERT_TRUE(by_kind.count("Deployment/plateau-coordinator"));
  ASSERT_TRUE(by_kind.count("Service/plateau-coordinator"));
  ASSERT_TRUE(by_kind.count("DaemonSet/plateau-worker"));
  ASSERT_TRUE(by_kind.count("Secret/plateau-token"));
  json deployment = by_kind["Deployment/plateau-coordinator"];
  json service = by_kind["Service/plateau-coordinator"];
  json daemonset = by_kind["DaemonSet/plateau-worker"];
  json secret = by_kind["Secret/plateau-token"];
  json cpod = deployment["spec"]["template"]["spec"];
  json wpod = daemonset["spec"]["template"]["spec"];
  ASSERT_EQ(cpod["containers"].size(), 1u);
  ASSERT_EQ(wpod["containers"].size(), 1u);
  json coordinator = cpod["containers"][0];
  json worker = wpod["containers"][0];
  std::map<std::string, std::string> cflags = Flags(coordinator), wflags = Flags(worker);

  // Ports: the flags, the container ports, the probes and the Service agree.
  EXPECT_EQ(PortOf(cflags["listen"]), std::to_string(ContainerPort(coordinator, "grpc")));
  EXPECT_EQ(PortOf(cflags["metrics_address"]), std::to_string(ContainerPort(coordinator, "metrics")));
  EXPECT_EQ(coordinator["livenessProbe"]["httpGet"]["port"], "metrics");
  EXPECT_EQ(coordinator["readinessProbe"]["httpGet"]["port"], "metrics");
  const std::string liveness = coordinator["livenessProbe"]["httpGet"]["path"];
  const std::string readiness = coordinator["readinessProbe"]["httpGet"]["path"];
  std::map<std::string, int> service_ports;
  for (const json& p : service["spec"]["ports"]) {
    EXPECT_GT(ContainerPort(coordinator, p["targetPort"].get<std::string>()), 0) << p.dump();
    service_ports[p["name"].get<std::string>()] = p["port"].get<int>();
  }
  EXPECT_EQ(service["spec"]["selector"], deployment["spec"]["template"]["metadata"]["labels"]);
  EXPECT_EQ(deployment["spec"]["selector"]["matchLabels"], deployment["spec"]["template"]["metadata"]["labels"]);
  EXPECT_EQ(daemonset["spec"]["selector"]["matchLabels"], daemonset["spec"]["template"]["metadata"]["labels"]);
  // The workers reach the coordinator through the Service.
  EXPECT_EQ(wflags["coordinator"], absl::StrCat(service["metadata"]["name"].get<std::string>(), ":", service_ports["grpc"]));
  // One Secret, mounted where both --token_file point.
  ASSERT_TRUE(secret["stringData"].contains("token")) << secret.dump();
  for (const auto& [pod, container, flags] : {std::tuple<const json&, const json&, std::map<std::string, std::string>&>{
                                                  cpod, coordinator, cflags},
                                              {wpod, worker, wflags}}) {
    ASSERT_FALSE(Volume(pod, "token").is_null());
    EXPECT_EQ(flags["token_file"], MountPath(container, "token") + "/token");
    EXPECT_EQ(Volume(pod, "token")["secret"]["secretName"], secret["metadata"]["name"]);
  }
  // The coordinator's state on its claim; SQLite has one writer.
  EXPECT_EQ(cflags["state_dir"], MountPath(coordinator, "state"));
  EXPECT_EQ(Volume(cpod, "state")["persistentVolumeClaim"]["claimName"], "plateau-coordinator-state");
  EXPECT_TRUE(by_kind.count("PersistentVolumeClaim/plateau-coordinator-state"));
  EXPECT_EQ(deployment["spec"]["replicas"], 1);
  EXPECT_EQ(deployment["spec"]["strategy"]["type"], "Recreate");
  // The workers: GPUs asked of Kubernetes = slots told to the coordinator;
  // ranks listen on the pod's address.
  EXPECT_EQ(wflags["backend"], "cuda");
  json gpus = worker["resources"]["limits"]["nvidia.com/gpu"];  // a quantity: "1" or 1
  EXPECT_EQ(gpus.is_string() ? gpus.get<std::string>() : gpus.dump(), wflags["devices"]);
  EXPECT_EQ(wflags["rank_address"], "$(POD_IP)");
  bool pod_ip = false;
  for (const json& e : worker["env"]) {
    pod_ip = pod_ip || (e["name"] == "POD_IP" && e["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP");
  }
  EXPECT_TRUE(pod_ip);
  EXPECT_GT(wpod["terminationGracePeriodSeconds"].get<double>(), std::stod(wflags["grace_s"]));
  EXPECT_EQ(Volume(wpod, "checkpoints")["persistentVolumeClaim"]["claimName"], "plateau-checkpoints");

  // The real binaries with the manifests' arguments. Only what cannot be
  // the manifest's here is replaced: paths (into this test's directory) and
  // the fixed ports (port 0: another test or run may hold 7070 or 9464; the
  // ports themselves were compared above).
  const std::string token_file = dir + "/token";
  std::ofstream(token_file) << "k8s-test-token-" << getpid() << "\n";
  std::vector<std::string> cargs = {"server/plateau_coordinator"};
  for (const json& a : coordinator["args"]) {
    std::string arg = a.get<std::string>();
    if (absl::StartsWith(arg, "--state_dir=")) arg = "--state_dir=" + dir + "/state";
    if (absl::StartsWith(arg, "--token_file=")) arg = "--token_file=" + token_file;
    if (absl::StartsWith(arg, "--listen=") || absl::StartsWith(arg, "--metrics_address=")) {
      arg = arg.substr(0, arg.rfind(':')) + ":0";
    }
    cargs.push_back(arg);
  }
  cargs.push_back("--ready_file=" + dir + "/ready");
  Process c(cargs, dir + "/coordinator");
  ASSERT_TRUE(WaitFor([&] { return std::filesystem::exists(dir + "/ready") || !c.Running(); }))
      << c.out() << c.err();
  ASSERT_TRUE(c.Running()) << "the coordinator refused the manifest's arguments: " << c.err();
  std::string api, metrics;
  for (absl::string_view line : absl::StrSplit(ReadFile(dir + "/ready"), '\n')) {
    if (absl::StartsWith(line, "api=")) api = "127.0.0.1:" + PortOf(std::string(line.substr(4)));
    if (absl::StartsWith(line, "metrics=")) metrics = "127.0.0.1:" + PortOf(std::string(line.substr(8)));
  }
  ASSERT_FALSE(metrics.empty()) << ReadFile(dir + "/ready");
  // The probes' paths answer 200 on the metrics port (readiness once the
  // store is recovered and the API serves).
  EXPECT_EQ(HttpStatus(HttpGet(metrics, liveness)), 200) << liveness;
  EXPECT_TRUE(WaitFor([&] { return HttpStatus(HttpGet(metrics, readiness)) == 200; }, absl::Seconds(30))) << readiness;
  EXPECT_EQ(HttpStatus(HttpGet(metrics, "/no-such-probe")), 404) << "the probe check above could not fail";

  // The worker agent with the DaemonSet's arguments (the fields Kubernetes
  // fills in: the pod IP and node name) registers with that coordinator.
  std::vector<std::string> wargs = {"worker/plateau_worker"};
  for (const json& a : worker["args"]) {
    std::string arg = a.get<std::string>();
    arg = absl::StrReplaceAll(arg, {{"$(POD_IP)", "127.0.0.1"}, {"$(NODE_NAME)", "k8s-node-a"}});
    if (absl::StartsWith(arg, "--coordinator=")) arg = "--coordinator=" + api;
    if (absl::StartsWith(arg, "--token_file=")) arg = "--token_file=" + token_file;
    if (absl::StartsWith(arg, "--work_dir=")) arg = "--work_dir=" + dir + "/work";
    wargs.push_back(arg);
  }
  // No GPU here: calibration of the cuda backend is skipped, and the memory
  // its GPUs have, which the agent reads at start (--device_memory_bytes=
  // auto, the manifest's default), is given; not the other flags.
  wargs.push_back("--calibrate=false");
  wargs.push_back("--device_memory_bytes=85899345920");
  Process w(wargs, dir + "/worker");
  EXPECT_TRUE(WaitFor([&] { return absl::StrContains(w.out(), "registered as worker-1") || !w.Running(); },
                      absl::Seconds(60)))
      << w.out() << w.err();
  EXPECT_THAT(w.out(), HasSubstr("(cuda, " + wflags["devices"] + " device(s)")) << w.out() << w.err();
  w.Stop();
  c.Stop();

  // The shipped placeholder token is refused: applied unchanged, nothing
  // serves with a token everyone can read here.
  const std::string placeholder = secret["stringData"]["token"];
  std::ofstream(dir + "/placeholder") << placeholder << "\n";
  std::vector<std::string> refused = cargs;
  for (std::string& a : refused) {
    if (absl::StartsWith(a, "--token_file=")) a = "--token_file=" + dir + "/placeholder";
    if (absl::StartsWith(a, "--ready_file=")) a = "--ready_file=" + dir + "/ready-placeholder";
  }
  Ran r = RunCommand(refused, dir + "/placeholder-run");
  EXPECT_NE(r.code, 0) << "the coordinator started with the placeholder token";
  EXPECT_THAT(r.err, HasSubstr("--token_file")) << r.err;
}

// A Kubernetes quantity in bytes ("512Mi", "64Gi", "2G", "1000"), -1 when
// it is none of these.
int64_t QuantityBytes(const json& q) {
  if (q.is_number_integer()) return q.get<int64_t>();
  if (!q.is_string()) return -1;
  std::string s = q.get<std::string>();
  int64_t unit = 1;
  for (const auto& [suffix, bytes] : std::vector<std::pair<std::string, int64_t>>{
           {"Ki", int64_t{1} << 10}, {"Mi", int64_t{1} << 20}, {"Gi", int64_t{1} << 30}, {"Ti", int64_t{1} << 40},
           {"k", 1000}, {"M", 1000000}, {"G", 1000000000}, {"T", 1000000000000}}) {
    if (absl::EndsWith(s, suffix)) {
      s.resize(s.size() - suffix.size());
      unit = bytes;
      break;
    }
  }
  int64_t n = 0;
  return absl::SimpleAtoi(s, &n) && n >= 0 ? n * unit : -1;
}

// The mount of `container` that `path` lies in or is (the longest such
// mountPath), or null.
json MountOf(const json& container, const std::string& path) {
  json best;
  for (const json& m : container.at("volumeMounts")) {
    const std::string at = m.at("mountPath");
    if ((path == at || absl::StartsWith(path, at + "/")) &&
        (best.is_null() || at.size() > best["mountPath"].get<std::string>().size())) {
      best = m;
    }
  }
  return best;
}

// A pod as NetworkPolicy sees it: its namespace, labels and (for named
// ports) container.
struct NetPod {
  std::string ns;
  json labels;
  json container = json::object();
};

// The namespace manifests without one land in, and the labels Kubernetes
// gives every namespace.
constexpr char kPlateauNamespace[] = "plateau";
json NamespaceLabels(const std::string& ns) { return {{"kubernetes.io/metadata.name", ns}}; }

// A label selector of matchLabels only (an empty one selects everything);
// one with matchExpressions is outside what this test evaluates.
bool Selects(const json& selector, const json& labels) {
  EXPECT_FALSE(selector.contains("matchExpressions")) << "this test evaluates matchLabels only: " << selector.dump();
  if (!selector.contains("matchLabels")) return true;
  for (auto it = selector["matchLabels"].begin(); it != selector["matchLabels"].end(); ++it) {
    if (!labels.contains(it.key()) || labels[it.key()] != *it) return false;
  }
  return true;
}

// A `from`/`to` peer of a policy in `policy_ns`: pods by podSelector in
// the namespaces of namespaceSelector (absent: the policy's own). An
// ipBlock peer never matches a pod here.
bool PeerMatches(const json& peer, const std::string& policy_ns, const NetPod& pod) {
  if (peer.contains("ipBlock")) return false;
  if (peer.contains("namespaceSelector")) {
    if (!Selects(peer["namespaceSelector"], NamespaceLabels(pod.ns))) return false;
  } else if (pod.ns != policy_ns) {
    return false;
  }
  return !peer.contains("podSelector") || Selects(peer["podSelector"], pod.labels);
}

// A rule's ports against a connection to `port`/`protocol` of `dest`
// (named ports: the destination container's).
bool PortMatches(const json& rule, const NetPod& dest, int port, const std::string& protocol) {
  if (!rule.contains("ports") || rule["ports"].empty()) return true;
  for (const json& p : rule["ports"]) {
    if (p.value("protocol", "TCP") != protocol) continue;
    if (!p.contains("port")) return true;
    if (p["port"].is_number() && p["port"].get<int>() == port) return true;
    if (p["port"].is_string() && dest.container.contains("ports") &&
        ContainerPort(dest.container, p["port"].get<std::string>()) == port) {
      return true;
    }
  }
  return false;
}

// Whether the policies let `from` open a connection to `to` on
// `port`/`protocol`: `to`'s ingress and `from`'s egress must both allow it
// (a pod no policy of that direction selects allows everything).
bool NetworkAllows(const std::vector<json>& policies, const NetPod& from, const NetPod& to, int port,
                   const std::string& protocol = "TCP") {
  bool ingress_selected = false, ingress_ok = false, egress_selected = false, egress_ok = false;
  for (const json& np : policies) {
    const std::string ns = np["metadata"].value("namespace", kPlateauNamespace);
    const json& spec = np["spec"];
    std::vector<std::string> types;
    if (spec.contains("policyTypes")) {
      for (const json& t : spec["policyTypes"]) types.push_back(t.get<std::string>());
    } else {
      types.push_back("Ingress");
      if (spec.contains("egress")) types.push_back("Egress");
    }
    const auto has = [&](const char* t) { return std::find(types.begin(), types.end(), t) != types.end(); };
    if (has("Ingress") && to.ns == ns && Selects(spec["podSelector"], to.labels)) {
      ingress_selected = true;
      for (const json& rule : spec.value("ingress", json::array())) {
        bool peer = !rule.contains("from") || rule["from"].empty();
        for (const json& f : rule.value("from", json::array())) peer = peer || PeerMatches(f, ns, from);
        ingress_ok = ingress_ok || (peer && PortMatches(rule, to, port, protocol));
      }
    }
    if (has("Egress") && from.ns == ns && Selects(spec["podSelector"], from.labels)) {
      egress_selected = true;
      for (const json& rule : spec.value("egress", json::array())) {
        bool peer = !rule.contains("to") || rule["to"].empty();
        for (const json& t : rule.value("to", json::array())) peer = peer || PeerMatches(t, ns, to);
        egress_ok = egress_ok || (peer && PortMatches(rule, to, port, protocol));
      }
    }
  }
  return (!ingress_selected || ingress_ok) && (!egress_selected || egress_ok);
}

// The workloads run confined and sized: a fixed non-root user, no
// privilege escalation, no capabilities, the runtime's seccomp filter, a
// read-only image with every path the binaries write on a writable volume,
// memory requests and limits (the worker's above the host memory it
// offers), no service account token; and the NetworkPolicies let workers
// and clients reach the gRPC port, Prometheus the metrics port and workers
// each other's ranks, and nothing else.
TEST(DeployTest, KubernetesWorkloadsAreConfinedSizedAndFenced) {
  const std::string dir = TempDir("kubernetes_confined");
  std::map<std::string, json> by_kind;
  ASSERT_NO_FATAL_FAILURE(DecodeManifests(dir, &by_kind));
  ASSERT_TRUE(by_kind.count("Deployment/plateau-coordinator"));
  ASSERT_TRUE(by_kind.count("DaemonSet/plateau-worker"));
  ASSERT_TRUE(by_kind.count("Service/plateau-coordinator"));
  const json deployment = by_kind["Deployment/plateau-coordinator"];
  const json daemonset = by_kind["DaemonSet/plateau-worker"];
  const json service = by_kind["Service/plateau-coordinator"];

  for (const json* workload : {&deployment, &daemonset}) {
    const json& pod = (*workload)["spec"]["template"]["spec"];
    const std::string name = (*workload)["metadata"]["name"];
    SCOPED_TRACE(name);
    EXPECT_EQ(pod.value("automountServiceAccountToken", true), false) << "neither binary calls the Kubernetes API";
    const json psc = pod.value("securityContext", json::object());
    EXPECT_EQ(psc.value("runAsNonRoot", false), true);
    EXPECT_GT(psc.value("runAsUser", 0), 0) << "a fixed uid";
    EXPECT_GT(psc.value("runAsGroup", 0), 0) << "a fixed gid";
    // The Secret (mode 0440) and the claims are the group's.
    EXPECT_EQ(psc.value("fsGroup", -1), psc.value("runAsGroup", 0));
    std::vector<json> containers;
    for (const char* list : {"initContainers", "containers"}) {
      for (const json& c : pod.value(list, json::array())) containers.push_back(c);
    }
    for (const json& c : containers) {
      SCOPED_TRACE(c["name"].get<std::string>());
      const json sc = c.value("securityContext", json::object());
      EXPECT_EQ(sc.value("allowPrivilegeEscalation", true), false);
      EXPECT_EQ(sc.value("readOnlyRootFilesystem", false), true);
      EXPECT_EQ(sc.value("privileged", false), false);
      EXPECT_NE(sc.value("runAsUser", 1), 0);
      EXPECT_NE(sc.value("runAsNonRoot", true), false);
      const json caps = sc.value("capabilities", json::object());
      EXPECT_EQ(caps.value("drop", json::array()), json::array({"ALL"}));
      EXPECT_TRUE(caps.value("add", json::array()).empty()) << "neither binary needs a capability: " << caps.dump();
      const json seccomp = sc.contains("seccompProfile") ? sc["seccompProfile"]
                                                         : psc.value("seccompProfile", json::object());
      EXPECT_EQ(seccomp.value("type", ""), "RuntimeDefault");
      const json res = c.value("resources", json::object());
      const int64_t request = QuantityBytes(res.value("requests", json::object()).value("memory", json()));
      const int64_t limit = QuantityBytes(res.value("limits", json::object()).value("memory", json()));
      EXPECT_GT(request, 0) << "no memory request: " << res.dump();
      EXPECT_TRUE(res.value("requests", json::object()).contains("cpu")) << "no CPU request: " << res.dump();
      EXPECT_GT(limit, 0) << "no memory limit: " << res.dump();
      EXPECT_LE(request, limit) << res.dump();
      // A read-only image: /tmp (libraries' temporary files, SQLite's) on a
      // volume of its own.
      const json tmp = MountOf(c, "/tmp");
      EXPECT_FALSE(tmp.is_null()) << "no volume at /tmp on a read-only root file system";
      if (!tmp.is_null()) {
        EXPECT_FALSE(tmp.value("readOnly", false));
      }
    }
  }

  // What each binary writes lies on a writable volume.
  const json cpod = deployment["spec"]["template"]["spec"], wpod = daemonset["spec"]["template"]["spec"];
  const json coordinator = cpod["containers"][0], worker = wpod["containers"][0];
  std::map<std::string, std::string> cflags = Flags(coordinator), wflags = Flags(worker);
  const json state = MountOf(coordinator, cflags["state_dir"]);
  ASSERT_FALSE(state.is_null()) << "--state_dir=" << cflags["state_dir"] << " is on the read-only image";
  EXPECT_FALSE(state.value("readOnly", false));
  const json work = MountOf(worker, wflags["work_dir"]);
  ASSERT_FALSE(work.is_null()) << "--work_dir=" << wflags["work_dir"] << " is on the read-only image";
  EXPECT_FALSE(work.value("readOnly", false));
  // Below the volume, not its root: the agent refuses a work dir it does
  // not own, and an emptyDir's own directory is root's.
  EXPECT_NE(work["mountPath"].get<std::string>(), wflags["work_dir"]);
  const json checkpoints = MountOf(worker, "/checkpoints");
  ASSERT_FALSE(checkpoints.is_null());
  EXPECT_FALSE(checkpoints.value("readOnly", false));
  // The worker's memory limit holds what it tells the coordinator its
  // ranks may plan on the host, and more.
  int64_t host_memory = 0;
  ASSERT_TRUE(absl::SimpleAtoi(wflags["host_memory_bytes"], &host_memory))
      << "the DaemonSet does not give --host_memory_bytes, which the coordinator places jobs by";
  EXPECT_GT(host_memory, 0);
  EXPECT_LT(host_memory, QuantityBytes(worker["resources"]["limits"]["memory"]));

  // The NetworkPolicies, for pods of this namespace and others.
  std::vector<json> policies;
  for (const auto& [key, obj] : by_kind) {
    if (obj["kind"] == "NetworkPolicy") policies.push_back(obj);
  }
  ASSERT_GE(policies.size(), 1u);
  const NetPod coordinator_pod{kPlateauNamespace, deployment["spec"]["template"]["metadata"]["labels"], coordinator};
  const NetPod worker_pod{kPlateauNamespace, daemonset["spec"]["template"]["metadata"]["labels"], worker};
  const NetPod client{"research", {{"plateau.dev/client", "true"}}};
  const NetPod prometheus{"monitoring", {{"app.kubernetes.io/name", "prometheus"}}};
  const NetPod dns{"kube-system", {{"k8s-app", "kube-dns"}}};
  const std::vector<NetPod> strangers = {NetPod{kPlateauNamespace, {{"app", "other"}}},
                                         NetPod{"research", {{"app", "other"}}},
                                         NetPod{"monitoring", {{"app.kubernetes.io/name", "grafana"}}}};
  // Both workloads are selected in both directions: what is not allowed
  // below is denied.
  for (const NetPod* p : {&coordinator_pod, &worker_pod}) {
    EXPECT_FALSE(NetworkAllows(policies, strangers[0], *p, 443)) << p->labels.dump() << " admits anyone";
    EXPECT_FALSE(NetworkAllows(policies, *p, strangers[1], 443)) << p->labels.dump() << " reaches anyone";
  }
  const int grpc = ContainerPort(coordinator, "grpc"), metrics = ContainerPort(coordinator, "metrics");
  ASSERT_GT(grpc, 0);
  ASSERT_GT(metrics, 0);
  // Every port the Service offers is reachable by whom it is for, and by no
  // stranger.
  for (const json& p : service["spec"]["ports"]) {
    const int target = ContainerPort(coordinator, p["targetPort"].get<std::string>());
    EXPECT_TRUE(target == grpc || target == metrics) << "a Service port this test does not know: " << p.dump();
    for (const NetPod& s : strangers) {
      EXPECT_FALSE(NetworkAllows(policies, s, coordinator_pod, target)) << s.labels.dump() << " -> " << p.dump();
    }
  }
  EXPECT_TRUE(NetworkAllows(policies, worker_pod, coordinator_pod, grpc)) << "workers and ranks -> the API";
  EXPECT_TRUE(NetworkAllows(policies, client, coordinator_pod, grpc)) << "clients -> the API";
  EXPECT_TRUE(NetworkAllows(policies, prometheus, coordinator_pod, metrics)) << "Prometheus -> /metrics";
  EXPECT_FALSE(NetworkAllows(policies, prometheus, coordinator_pod, grpc));
  EXPECT_FALSE(NetworkAllows(policies, client, coordinator_pod, metrics));
  EXPECT_FALSE(NetworkAllows(policies, client, worker_pod, 40000)) << "clients never call a worker";
  EXPECT_FALSE(NetworkAllows(policies, coordinator_pod, worker_pod, 40000)) << "the coordinator never calls a worker";
  // Ranks listen where Gloo and NCCL bind port 0: any port the kernel may
  // pick, from another worker only.
  for (int port : {1024, 29500, 32768, 45678, 60999, 65535}) {
    EXPECT_TRUE(NetworkAllows(policies, worker_pod, worker_pod, port)) << "rank to rank on " << port;
    for (const NetPod& s : strangers) EXPECT_FALSE(NetworkAllows(policies, s, worker_pod, port)) << port;
  }
  // The workers find the coordinator's Service by name.
  EXPECT_TRUE(NetworkAllows(policies, worker_pod, dns, 53, "UDP"));
  EXPECT_TRUE(NetworkAllows(policies, worker_pod, dns, 53, "TCP"));
}

}  // namespace
}  // namespace plateau
