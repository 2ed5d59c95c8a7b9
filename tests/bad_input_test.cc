// Bad input against a real coordinator process (no worker: jobs stay
// PENDING): malformed spec fields through SubmitJob over gRPC, spec files
// plateauctl cannot parse, and a fuzz run of raw and mutated SubmitJob
// requests from several threads. Nothing invalid may become a job, every
// call must return within its deadline, and the coordinator must still be
// alive and answering afterwards.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <fstream>
#include <functional>
#include <future>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "client/client.h"
#include "gmock/gmock.h"
#include "google/protobuf/any.pb.h"
#include "google/protobuf/descriptor.h"
#include "google/protobuf/descriptor.pb.h"
#include "google/protobuf/dynamic_message.h"
#include "google/protobuf/io/coded_stream.h"
#include "google/protobuf/io/zero_copy_stream_impl_lite.h"
#include "google/protobuf/stubs/logging.h"
#include "google/protobuf/text_format.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "plateau/v1/job.grpc.pb.h"
#include "proto/does_not_fit.h"
#include "server/coordinator.h"
#include "tests/cluster.h"
#include "tests/spec_fuzz.h"
#include "worker/job_spec.h"

namespace plateau {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;
using namespace testing_cluster;  // NOLINT: the harness is this file's vocabulary

ClusterOptions NoWorker() {
  ClusterOptions o;
  o.with_worker = false;
  return o;
}

// Every job the coordinator holds, over all pages.
std::vector<v1::Job> AllJobs(Client& client) {
  std::vector<v1::Job> jobs;
  v1::ListJobsRequest req;
  req.set_page_size(1000);
  do {
    auto page = client.ListJobs(req);
    EXPECT_TRUE(page.ok()) << page.status();
    if (!page.ok()) break;
    for (const v1::Job& j : page->jobs()) jobs.push_back(j);
    req.set_page_token(page->next_page_token());
  } while (!req.page_token().empty());
  return jobs;
}

// A representative malformed value of each part of the spec, through the
// real RPC (worker/job_spec_test.cc has the exhaustive table): the code and
// the field survive the trip through gRPC, with and without validate_only,
// and nothing is created.
TEST(BadInputTest, SubmitJobRefusesMalformedFieldsNamingThem) {
  Cluster c("bad-fields", NoWorker());
  ASSERT_TRUE(c.ready()) << c.Logs();
  using S = v1::JobSpec;
  struct Case {
    std::string field;
    std::function<void(S&)> mutate;
    absl::StatusCode code = absl::StatusCode::kInvalidArgument;
  };
  const std::vector<Case> cases = {
      {"name", [](S& s) { s.set_name(std::string(1000, 'n')); }},
      {"model", [](S& s) { s.clear_model(); }},
      {"model.vocab_size", [](S& s) { s.mutable_model()->set_vocab_size(std::numeric_limits<int64_t>::max()); }},
      {"model.hidden", [](S& s) { s.mutable_model()->set_hidden(-64); }},
      {"model.layers", [](S& s) { s.mutable_model()->set_layers(int64_t{1} << 20); }},
      {"model.kv_heads", [](S& s) { s.mutable_model()->set_kv_heads(0); }},
      {"model.norm_eps", [](S& s) { s.mutable_model()->set_norm_eps(std::nanf("")); }},
      {"model", [](S& s) {  // tokens x top_k x hidden would overflow the dispatch plan
         s.mutable_layout()->set_batch(int64_t{1} << 10);
         s.mutable_model()->set_seq_len(int64_t{1} << 11);
         s.mutable_model()->set_hidden(int64_t{1} << 20);
         s.mutable_model()->set_experts(int64_t{1} << 20);
         s.mutable_model()->set_top_k(int64_t{1} << 20);
         s.mutable_model()->set_expert_ffn(1);
       }},
      {"layout.ranks", [](S& s) { s.mutable_layout()->set_ranks(std::numeric_limits<int64_t>::min()); }},
      {"layout.batch", [](S& s) { s.mutable_layout()->set_batch(0); }},
      {"schedule.ring_dtp.row_tile", [](S& s) { s.mutable_schedule()->mutable_ring_dtp()->set_row_tile(-1); }},
      {"schedule.sco.host_budget_bytes",
       [](S& s) { s.mutable_schedule()->mutable_sco()->set_host_budget_bytes(-1); }},
      {"optimizer.lr", [](S& s) { s.mutable_optimizer()->set_lr(INFINITY); }},
      {"optimizer.beta2", [](S& s) { s.mutable_optimizer()->set_beta2(1); }},
      {"data.recall.queries", [](S& s) { s.mutable_data()->mutable_recall()->set_queries(-1); }},
      {"data.text.path", [](S& s) { s.mutable_data()->mutable_text()->set_path("corpus.txt"); }},
      {"data.shards.paths[0]", [](S& s) { s.mutable_data()->mutable_shards()->add_paths(""); }},
      {"steps", [](S& s) { s.set_steps(std::numeric_limits<int64_t>::max()); }},
      {"checkpoint.every", [](S& s) {
         s.mutable_checkpoint()->set_directory("/tmp/c");
         s.mutable_checkpoint()->set_every(-1);
       }},
      {"max_restarts", [](S& s) { s.set_max_restarts(std::numeric_limits<int32_t>::max()); }},
      {"backend", [](S& s) { s.set_backend(static_cast<v1::Backend>(42)); }},
      {"device_memory_bytes", [](S& s) { s.set_device_memory_bytes(-1); }},
      {"host_memory_bytes", [](S& s) { s.set_host_memory_bytes(std::numeric_limits<int64_t>::min()); }},
  };
  for (bool validate_only : {true, false}) {
    for (const Case& k : cases) {
      v1::JobSpec s = TinyJob(5);
      k.mutate(s);
      const absl::Time t0 = absl::Now();
      auto r = c.client().SubmitJob(s, validate_only);
      EXPECT_EQ(r.status().code(), k.code) << k.field << ": " << r.status();
      EXPECT_THAT(std::string(r.status().message()), HasSubstr(k.field + ":")) << r.status();
      EXPECT_LT(absl::Now() - t0, absl::Seconds(5)) << k.field;
    }
  }
  EXPECT_TRUE(AllJobs(c.client()).empty()) << "nothing may have been created";
  EXPECT_TRUE(c.coordinator()->Running());
}

// "Wrong type in the file": plateauctl exits 2 naming file:line:column and
// the field, and creates nothing.
TEST(BadInputTest, PlateauctlRefusesSpecFilesThatDoNotParse) {
  Cluster c("bad-files", NoWorker());
  ASSERT_TRUE(c.ready()) << c.Logs();
  struct File {
    std::string name, text, where, field;
  };
  const std::vector<File> files = {
      {"string-for-int", "model {\n  hidden: \"sixty-four\"\n}\n", ":2:11: ", "model.hidden (int64): Expected integer"},
      {"unknown-field", "steps: 5\nlayout {\n  rank: 2\n}\n", ":3:3: ", "layout.rank: "},
      {"bad-enum", "steps: 5\nbackend: BACKEND_TPU\n", ":2:10: ", "backend (enum plateau.v1.Backend): Unknown enumeration"},
      {"out-of-range", "max_restarts: 4294967296\n", ":1:15: ", "max_restarts (int32): Integer out of range"},
      {"not-utf8", "name: \"\\377\"\n", ":1:1: ", "name (string): expected UTF-8"},
  };
  for (const File& f : files) {
    const std::string path = c.dir() + "/" + f.name + ".txtpb";
    std::ofstream(path) << f.text;
    Ran r = RunCommand({"client/plateauctl", "--coordinator=" + c.api(), "submit", path}, c.dir() + "/" + f.name);
    EXPECT_EQ(r.code, 2) << f.name << ": " << r.err;
    EXPECT_THAT(r.err, HasSubstr(path + f.where)) << f.name;
    EXPECT_THAT(r.err, HasSubstr(f.field)) << f.name;
    // The file's fault, said as the command's: no status code, which would
    // read as the coordinator's refusal.
    EXPECT_THAT(r.err, HasSubstr("plateauctl submit: " + path + f.where)) << f.name;
    EXPECT_THAT(r.err, ::testing::Not(HasSubstr("INVALID_ARGUMENT"))) << f.name;
  }
  EXPECT_TRUE(AllJobs(c.client()).empty()) << "nothing may have been created";
}

// TinyJob under standard EP (whose dispatch follows the routing, so
// force_launch can launch below its worst case; PipelinedLLEP's bound is
// launch-sized) with a device cap one byte under its plan.
absl::StatusOr<v1::JobSpec> SpecOneByteOverItsCap(Cluster& c) {
  v1::JobSpec spec = TinyJob(5);
  spec.mutable_schedule()->mutable_standard_ep();
  auto plan = c.client().PlanJob(spec);
  if (!plan.ok()) return plan.status();
  spec.set_device_memory_bytes(plan->plan().total_bytes() - 1);
  return spec;
}

// A spec whose plan does not fit its cap: `plan` prints it and exits 5,
// `submit --validate-only` and `submit` are refused with 5 naming the
// shortfall and force_launch, and nothing is created; with force_launch the
// same spec validates.
TEST(BadInputTest, PlateauctlExitsNonZeroWhenThePlanDoesNotFit) {
  Cluster c("no-fit", NoWorker());
  ASSERT_TRUE(c.ready()) << c.Logs();
  absl::StatusOr<v1::JobSpec> over = SpecOneByteOverItsCap(c);
  ASSERT_TRUE(over.ok()) << over.status();
  v1::JobSpec spec = *over;
  std::string text;
  ASSERT_TRUE(google::protobuf::TextFormat::PrintToString(spec, &text));
  const std::string path = c.dir() + "/no-fit.txtpb";
  std::ofstream(path) << text;
  const std::string ctl = "client/plateauctl", at = "--coordinator=" + c.api();
  Ran p = RunCommand({ctl, at, "plan", path}, c.dir() + "/plan");
  EXPECT_EQ(p.code, 5) << p.out << p.err;
  EXPECT_THAT(p.out, HasSubstr("DOES NOT FIT (short by 1 bytes, 0.00 MiB)"));
  for (const std::vector<std::string>& args :
       {std::vector<std::string>{ctl, at, "submit", path, "--validate-only"},
        std::vector<std::string>{ctl, at, "submit", path}}) {
    Ran r = RunCommand(args, c.dir() + "/submit" + std::to_string(args.size()));
    EXPECT_EQ(r.code, 5) << r.out << r.err;
    EXPECT_THAT(r.err, AllOf(HasSubstr("RESOURCE_EXHAUSTED"), HasSubstr("short by 1 bytes"),
                             HasSubstr("force_launch")));
  }
  EXPECT_TRUE(AllJobs(c.client()).empty()) << "nothing may have been created";
  std::ofstream(path, std::ios::app) << "force_launch: true\n";
  Ran forced = RunCommand({ctl, at, "submit", path, "--validate-only"}, c.dir() + "/forced");
  EXPECT_EQ(forced.code, 0) << forced.out << forced.err;
  EXPECT_THAT(forced.out, HasSubstr("note: force_launch"));
}

// `auto` settings of which no value fits the spec's cap: submit is refused
// with the chooser's reason, typed (the client sees DoesNotFit naming the
// cap, which plateauctl's exit 5 reads), and nothing is created.
TEST(BadInputTest, AutoSettingsThatFitNoValueAreRefusedTyped) {
  Cluster c("auto-no-fit", NoWorker());
  ASSERT_TRUE(c.ready()) << c.Logs();
  v1::JobSpec spec = TinyJob(5);
  spec.mutable_schedule()->mutable_pipelined_llep()->clear_chunk_tokens();
  spec.mutable_schedule()->mutable_pipelined_llep()->set_chunk_tokens_auto(true);
  spec.set_device_memory_bytes(1000);
  auto plan = c.client().PlanJob(spec);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_FALSE(plan->plan().fits());
  ASSERT_TRUE(plan->plan().has_auto_nothing_fits());
  EXPECT_EQ(plan->plan().auto_nothing_fits().cap(), "device_memory_bytes");
  EXPECT_EQ(plan->plan().auto_nothing_fits().cap_bytes(), 1000);
  EXPECT_FALSE(plan->plan().auto_nothing_fits().cap_of_the_worker());
  auto refused = c.client().SubmitJob(spec, false);
  ASSERT_FALSE(refused.ok());
  const std::optional<v1::DoesNotFit> typed = DoesNotFitOf(refused.status());
  ASSERT_TRUE(typed.has_value()) << refused.status();
  EXPECT_EQ(typed->cap(), "device_memory_bytes");
  EXPECT_THAT(refused.status().message(), HasSubstr("no value of the `auto` settings fits"));
  std::string text;
  ASSERT_TRUE(google::protobuf::TextFormat::PrintToString(spec, &text));
  const std::string path = c.dir() + "/auto-no-fit.txtpb";
  std::ofstream(path) << text;
  Ran r = RunCommand({"client/plateauctl", "--coordinator=" + c.api(), "submit", path}, c.dir() + "/submit");
  EXPECT_EQ(r.code, 5) << r.out << r.err;
  EXPECT_THAT(r.err, HasSubstr("no value of the `auto` settings fits"));
  EXPECT_TRUE(AllJobs(c.client()).empty()) << "nothing may have been created";
  // Other refusals carry no such type: a malformed spec is not "does not fit".
  spec.mutable_layout()->set_ranks(3);
  auto bad = c.client().SubmitJob(spec, false);
  ASSERT_FALSE(bad.ok());
  EXPECT_FALSE(DoesNotFitOf(bad.status()).has_value()) << bad.status();
}

// googleapis' google/rpc/status.proto, as its descriptor: the definition
// that gRPC's clients parse the grpc-status-details-bin trailer with
// (Python's grpc_status.rpc_status.from_call, grpc-go's status.FromError).
// Spelled here rather than taken from plateau.v1.RpcStatus, so that the
// test checks the bytes against the standard, not against our twin of it.
constexpr char kGoogleRpcStatusProto[] = R"pb(
  name: "google/rpc/status.proto"
  package: "google.rpc"
  dependency: "google/protobuf/any.proto"
  syntax: "proto3"
  message_type {
    name: "Status"
    field { name: "code" number: 1 label: LABEL_OPTIONAL type: TYPE_INT32 }
    field { name: "message" number: 2 label: LABEL_OPTIONAL type: TYPE_STRING }
    field { name: "details" number: 3 label: LABEL_REPEATED type: TYPE_MESSAGE type_name: ".google.protobuf.Any" }
  }
)pb";

// A submit refused because its plan does not fit: the status' details (the
// grpc-status-details-bin trailer) parse as a google.rpc.Status with the
// call's code and message and one detail, an Any that unpacks to
// plateau.v1.DoesNotFit naming the cap. (They were the DoesNotFit itself,
// which standard clients misparse: as a google.rpc.Status it has code 0
// and no details.) The client still reads a coordinator's that sent that.
TEST(BadInputTest, DoesNotFitTravelsAsAGoogleRpcStatusInTheTrailer) {
  Cluster c("no-fit-status", NoWorker());
  ASSERT_TRUE(c.ready()) << c.Logs();
  absl::StatusOr<v1::JobSpec> over = SpecOneByteOverItsCap(c);
  ASSERT_TRUE(over.ok()) << over.status();
  const v1::JobSpec spec = *over;

  google::protobuf::Any::descriptor();  // google/protobuf/any.proto into the generated pool
  google::protobuf::FileDescriptorProto file;
  ASSERT_TRUE(google::protobuf::TextFormat::ParseFromString(kGoogleRpcStatusProto, &file));
  google::protobuf::DescriptorPool pool(google::protobuf::DescriptorPool::generated_pool());
  ASSERT_NE(pool.BuildFile(file), nullptr);
  const google::protobuf::Descriptor* status_type = pool.FindMessageTypeByName("google.rpc.Status");
  ASSERT_NE(status_type, nullptr);
  google::protobuf::DynamicMessageFactory factory(&pool);

  auto stub = v1::JobService::NewStub(grpc::CreateChannel(c.api(), grpc::InsecureChannelCredentials()));
  for (const bool validate_only : {true, false}) {
    SCOPED_TRACE(validate_only ? "validate_only" : "submit");
    v1::SubmitJobRequest req;
    *req.mutable_spec() = spec;
    req.set_validate_only(validate_only);
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
    v1::SubmitJobResponse resp;
    const grpc::Status s = stub->SubmitJob(&ctx, req, &resp);
    ASSERT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << s.error_message();
    ASSERT_FALSE(s.error_details().empty()) << "no grpc-status-details-bin trailer";

    std::unique_ptr<google::protobuf::Message> status(factory.GetPrototype(status_type)->New());
    ASSERT_TRUE(status->ParseFromString(s.error_details()));
    const google::protobuf::Reflection* r = status->GetReflection();
    EXPECT_TRUE(r->GetUnknownFields(*status).empty()) << "fields google.rpc.Status does not have";
    EXPECT_EQ(r->GetInt32(*status, status_type->FindFieldByName("code")),
              static_cast<int>(grpc::StatusCode::RESOURCE_EXHAUSTED));
    EXPECT_EQ(r->GetString(*status, status_type->FindFieldByName("message")), s.error_message());
    const google::protobuf::FieldDescriptor* details = status_type->FindFieldByName("details");
    ASSERT_EQ(r->FieldSize(*status, details), 1) << status->DebugString();
    google::protobuf::Any any;
    ASSERT_TRUE(any.ParseFromString(r->GetRepeatedMessage(*status, details, 0).SerializeAsString()));
    EXPECT_EQ(any.type_url(), "type.googleapis.com/plateau.v1.DoesNotFit");
    v1::DoesNotFit d;
    ASSERT_TRUE(any.UnpackTo(&d));
    EXPECT_EQ(d.cap(), "device_memory_bytes");
  }

  // Through the client: the type back as the payload (plateauctl's exit 5).
  auto refused = c.client().SubmitJob(spec, false);
  ASSERT_FALSE(refused.ok());
  ASSERT_TRUE(DoesNotFitOf(refused.status()).has_value()) << refused.status();
  EXPECT_EQ(DoesNotFitOf(refused.status())->cap(), "device_memory_bytes");
  // A coordinator from before sent the bare DoesNotFit: still read.
  v1::DoesNotFit bare;
  bare.set_cap("host_memory_bytes");
  absl::Status old = absl::ResourceExhaustedError("host_memory_bytes: ...");
  PayloadsFromGrpcStatusDetails(bare.SerializeAsString(), &old);
  ASSERT_TRUE(DoesNotFitOf(old).has_value());
  EXPECT_EQ(DoesNotFitOf(old)->cap(), "host_memory_bytes");
  // Other refusals carry no details.
  absl::Status plain = absl::ResourceExhaustedError("too many watches");
  EXPECT_EQ(GrpcStatusDetails(plain), "");
  EXPECT_TRUE(AllJobs(c.client()).empty()) << "nothing may have been created";
}

// One unary SubmitJob with `body` as the raw request bytes, through the
// generic stub: what a client that does not use our proto can send.
grpc::Status RawSubmit(grpc::GenericStub& stub, const std::string& body, absl::Duration deadline,
                       std::string* response) {
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + absl::ToChronoMilliseconds(deadline));
  grpc::Slice slice(body);
  grpc::ByteBuffer req(&slice, 1), resp;
  std::promise<grpc::Status> done;
  stub.UnaryCall(&ctx, "/plateau.v1.JobService/SubmitJob", grpc::StubOptions(), &req, &resp,
                 [&done](grpc::Status s) { done.set_value(std::move(s)); });
  std::future<grpc::Status> f = done.get_future();
  // The deadline bounds the call; a callback that never comes is a gRPC bug
  // that would leave `ctx` in use, so stop here rather than hang.
  if (f.wait_for(absl::ToChronoMilliseconds(deadline + absl::Seconds(30))) != std::future_status::ready) {
    std::fprintf(stderr, "SubmitJob never completed\n");
    std::abort();
  }
  grpc::Status s = f.get();
  std::vector<grpc::Slice> slices;
  response->clear();
  if (s.ok() && resp.Dump(&slices).ok()) {
    for (const grpc::Slice& sl : slices) response->append(reinterpret_cast<const char*>(sl.begin()), sl.size());
  }
  return s;
}

// A fuzz run over gRPC: random bytes and mutated requests, raw through the
// generic stub and typed through the client, from four threads. The
// coordinator's answer to each parseable request must be what the
// validator says in process; an unparseable one is refused; no call
// outlives its deadline; afterwards the coordinator is alive, and the jobs
// it holds are exactly the accepted non-validate_only submissions, each
// with a spec that validates.
TEST(BadInputTest, FuzzedSubmitJobNeverCrashesHangsOrCreatesAnInvalidJob) {
  google::protobuf::SetLogHandler(nullptr);  // non-UTF-8 strings would be logged by the thousand
  Cluster c("fuzz-submit", NoWorker());
  ASSERT_TRUE(c.ready()) << c.Logs();
  const int kThreads = 4, kPerThread = 1000;
  const absl::Duration kDeadline = absl::Seconds(10);
  std::atomic<int> created{0}, accepted{0}, refused{0};
  std::mutex mu;
  std::vector<std::string> failures;  // guarded by mu
  absl::Duration slowest;             // guarded by mu
  std::vector<std::string> ids;       // guarded by mu
  std::map<std::string, int> codes;   // guarded by mu: the replies, by code
  auto fail = [&](std::string what) {
    std::lock_guard<std::mutex> l(mu);
    if (failures.size() < 20) failures.push_back(std::move(what));
  };
  auto run = [&](int t) {
    spec_fuzz::SpecMutator m(1000 + t);
    auto channel = grpc::CreateChannel(c.api(), grpc::InsecureChannelCredentials());
    grpc::GenericStub raw(channel);
    Client typed(c.api(), kDeadline);
    for (int i = 0; i < kPerThread; ++i) {
      const std::string where = absl::StrCat("thread ", t, " iteration ", i);
      spec_fuzz::SpecMutator::Input in = m.Next();
      const bool validate_only = m.rng()() % 2 == 0;
      std::string body;
      const absl::Time t0 = absl::Now();
      grpc::Status status;
      std::string response;
      v1::SubmitJobRequest want;  // what the coordinator parses, when it can
      bool parses = false;
      if (in.kind == spec_fuzz::SpecMutator::Kind::kFieldValues) {
        // Typed, through the client as plateauctl sends it.
        *want.mutable_spec() = in.spec;
        want.set_validate_only(validate_only);
        parses = v1::SubmitJobRequest().ParseFromString(want.SerializeAsString());
        auto r = typed.SubmitJob(in.spec, validate_only);
        status = r.ok() ? grpc::Status::OK
                        : grpc::Status(static_cast<grpc::StatusCode>(r.status().code()), std::string(r.status().message()));
        if (r.ok()) response = r->SerializeAsString();
      } else {
        if (in.kind == spec_fuzz::SpecMutator::Kind::kRandomBytes || m.rng()() % 4 == 0) {
          body = in.bytes;  // the whole request is the fuzzed bytes
        } else {
          // A request whose spec field holds the fuzzed bytes.
          v1::SubmitJobRequest shell;
          shell.set_validate_only(validate_only);
          body = shell.SerializeAsString();
          std::string field;
          google::protobuf::io::StringOutputStream so(&field);
          {
            google::protobuf::io::CodedOutputStream out(&so);
            out.WriteTag((1 << 3) | 2);
            out.WriteVarint32(static_cast<uint32_t>(in.bytes.size()));
            out.WriteRaw(in.bytes.data(), static_cast<int>(in.bytes.size()));
          }
          body = field + body;
        }
        parses = want.ParseFromString(body);
        status = RawSubmit(raw, body, kDeadline, &response);
      }
      const absl::Duration took = absl::Now() - t0;
      {
        std::lock_guard<std::mutex> l(mu);
        slowest = std::max(slowest, took);
      }
      {
        std::lock_guard<std::mutex> l(mu);
        ++codes[absl::StrCat(parses ? "" : "unparseable: ", absl::StatusCodeToString(
                                                                static_cast<absl::StatusCode>(status.error_code())))];
      }
      const std::string input = absl::StrCat(where, " (", spec_fuzz::KindName(in.kind), ": ", in.what, ")");
      if (status.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED ||
          status.error_code() == grpc::StatusCode::UNAVAILABLE || took > kDeadline) {
        fail(absl::StrCat("no timely answer: ", status.error_message(), " after ", absl::FormatDuration(took),
                          "; ", input));
        continue;
      }
      if (!parses) {
        // gRPC refuses what does not deserialize (INTERNAL) before our code.
        if (status.ok()) fail(absl::StrCat("an unparseable request was accepted; ", input));
        ++refused;
        continue;
      }
      // The coordinator checks the request id first, then the spec.
      absl::Status expect = CheckRequestId(want.request_id());
      if (expect.ok()) expect = AdmitJob(want.spec()).status();
      // A valid request id the fuzz made twice with another spec.
      const bool reused_id = expect.ok() && !want.request_id().empty() && !want.validate_only() &&
                             status.error_code() == grpc::StatusCode::ALREADY_EXISTS;
      if (!reused_id && static_cast<int>(status.error_code()) != static_cast<int>(expect.code())) {
        fail(absl::StrCat("coordinator said ", status.error_code(), " ", status.error_message(),
                          ", the validator says ", expect.ToString(), "; ", input));
        continue;
      }
      if (!status.ok()) {
        ++refused;
        continue;
      }
      ++accepted;
      v1::SubmitJobResponse r;
      if (!r.ParseFromString(response)) {
        fail(absl::StrCat("an OK reply that does not parse; ", input));
        continue;
      }
      if (want.validate_only() != !r.has_job()) {
        fail(absl::StrCat("validate_only=", want.validate_only(), " but job=", r.job().id(), "; ", input));
      }
      if (r.has_job()) {
        ++created;
        std::lock_guard<std::mutex> l(mu);
        ids.push_back(r.job().id());
      }
    }
  };
  const absl::Time start = absl::Now();
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) threads.emplace_back(run, t);
  for (std::thread& t : threads) t.join();
  const absl::Duration elapsed = absl::Now() - start;
  std::printf("%d requests in %s (slowest %s): %d accepted (%d created), %d refused\n", kThreads * kPerThread,
              absl::FormatDuration(elapsed).c_str(), absl::FormatDuration(slowest).c_str(), accepted.load(),
              created.load(), refused.load());
  for (const auto& [code, n] : codes) std::printf("  %s: %d\n", code.c_str(), n);
  for (const std::string& f : failures) ADD_FAILURE() << f;
  EXPECT_EQ(accepted + refused + static_cast<int>(failures.size()), kThreads * kPerThread);

  // Still alive, still answering, still accepting a good job.
  ASSERT_TRUE(c.coordinator()->Running()) << c.Logs();
  auto ok = c.client().SubmitJob(TinyJob(5), /*validate_only=*/true);
  EXPECT_TRUE(ok.ok()) << ok.status();
  const std::vector<v1::Job> jobs = AllJobs(c.client());
  EXPECT_EQ(static_cast<int>(jobs.size()), created.load()) << "jobs exist that no OK reply created, or the reverse";
  std::vector<std::string> listed;
  for (const v1::Job& j : jobs) {
    listed.push_back(j.id());
    // Nothing can host them here, so each waits (PENDING), except a fuzzed
    // max_pending_s shorter than the run, which fails it as unschedulable
    // once that long has passed (a slow, loaded machine reaches more).
    if (j.state() == v1::FAILED) {
      EXPECT_EQ(j.failure().kind(), v1::Failure::UNSCHEDULABLE) << j.DebugString();
      EXPECT_GT(j.spec().max_pending_s(), 0) << j.DebugString();
      EXPECT_LE(absl::Seconds(j.spec().max_pending_s()), absl::Now() - start) << j.DebugString();
    } else {
      EXPECT_EQ(j.state(), v1::PENDING) << j.id();
    }
    const absl::Status v = ValidateJobSpec(j.spec());
    EXPECT_TRUE(v.ok()) << j.id() << " holds a spec the validator refuses: " << v << "\n" << j.spec().DebugString();
  }
  std::sort(ids.begin(), ids.end());
  std::sort(listed.begin(), listed.end());
  EXPECT_EQ(listed, ids);
  // The fuzzing must reach both sides to mean anything.
  EXPECT_GT(created.load(), 10);
  EXPECT_GT(refused.load(), kThreads * kPerThread / 2);
}

}  // namespace
}  // namespace plateau
