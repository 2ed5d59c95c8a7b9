#include "client/spec_file.h"

#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "google/protobuf/text_format.h"
#include "gtest/gtest.h"

namespace plateau {
namespace {

using ::testing::HasSubstr;

struct Bad {
  std::string text;
  std::string where;  // "LINE:COLUMN: FIELD (TYPE): "
  std::string what;   // a further part of the message
};

// Each kind of "wrong type in the file" names the place and the field in
// the validator's dotted form, with its type and what was expected.
TEST(SpecFileTest, ParseErrorsNameTheLineColumnAndField) {
  const std::vector<Bad> cases = {
      {"model {\n  hidden: \"abc\"\n}\n", "2:11: model.hidden (int64): ", "Expected integer"},
      {"model {\n  hidden: abc\n}\n", "2:11: model.hidden (int64): ", "Expected integer, got: abc"},
      {"optimizer { lr: \"fast\" }", "1:17: optimizer.lr (float): ", "Expected double"},
      {"steps: 99999999999999999999\n", "1:8: steps (int64): ", "Integer out of range"},
      {"max_restarts: 3000000000", "1:15: max_restarts (int32): ", "Integer out of range"},
      {"seed: -1", "1:7: seed (uint64): ", ""},
      {"name: 5", "1:7: name (string): ", "Expected string"},
      {"model { hiden: 64 }", "1:9: model.hiden: ",
       "\"hiden\"; the fields of plateau.v1.ModelSpec are vocab_size, hidden,"},
      {"# a comment: { with braces\nstepz: 3", "2:1: stepz: ", "has no field named \"stepz\""},
      {"backend: BACKEND_TPU\nsteps: 5\n", "1:10: backend (enum plateau.v1.Backend): ",
       "expected one of BACKEND_UNSPECIFIED, BACKEND_CPU, BACKEND_CUDA"},
      {"schedule {\n  ring_dtp { mode: MODE_FAST strip: 8 }\n}\n",
       "2:20: schedule.ring_dtp.mode (enum plateau.v1.RingDtpProjection.Mode): ",
       "MODE_ACTIVATIONS"},
      {"steps: 1\nsteps: 2\n", "2:1: steps (int64): ", "specified multiple times"},
      {"data { shards { paths: [\"/a\", 5] } }",
       "1:31: data.shards.paths (repeated string): ", "Expected string"},
      {"layout { ranks: 2 nodes: -x }", "1:27: layout.nodes (int64): ", "Expected integer"},
      {"model { hidden: 64\n",
       "2:1: model (message plateau.v1.ModelSpec): ", "got: the end of the file"},
      {"model { hidden: 64 } }", "1:22: ", "Expected identifier"},
      {"name: \"ok\"\ndata { shards { paths: \"/a\" paths: \"/b\\377\" } }",
       "2:29: data.shards.paths[1] (string): ", "expected UTF-8 text"},
      {"optimizer { beta1: 0.9 beta2: 1e9x }", "1:34: optimizer.beta2 (float): ", "Need space"},
      {"labels { key: \"team\" value: \"a\" }\nlabels { key: \"team\" value: \"b\" }\n",
       "2:10: labels: the key \"team\" is given again (first at 1:10)", "a label has one value"},
      {"labels [{ key: \"t\" \"eam\" value: \"a\" }, { value: \"x\" },\n\t{ key: \"team\" value: "
       "\"b\" }]",
       "2:11: labels: the key \"team\" is given again (first at 1:11)", ""},
      {"labels { value: \"a\" } labels { value: \"b\" }",
       "1:23: labels: the key \"\" is given again (first at 1:1)", ""},
  };
  for (const Bad& c : cases) {
    auto spec = ParseSpecText(c.text, "job.txtpb");
    ASSERT_FALSE(spec.ok()) << c.text;
    EXPECT_EQ(spec.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(std::string(spec.status().message()), HasSubstr("job.txtpb:" + c.where)) << c.text;
    EXPECT_THAT(std::string(spec.status().message()), HasSubstr(c.what)) << c.text;
  }
}

// Distinct keys, however written, are no repeat.
TEST(SpecFileTest, DistinctLabelKeysAllParse) {
  auto spec = ParseSpecText(
      "labels { key: \"team\" value: \"a\" }\n# key: \"team\"\nlabels: { key: \"te\" \"am2\" "
      "value: \"team\" }\n"
      "labels [{ key: \"x\" }, { key: \"y\" value: \"team\" }]",
      "job.txtpb");
  ASSERT_TRUE(spec.ok()) << spec.status();
  EXPECT_EQ(spec->labels_size(), 4);
  EXPECT_EQ(spec->labels().at("team2"), "team");
}

// What `plateauctl submit -` reads: a stream, its errors under its name,
// bounded as a file is.
TEST(SpecFileTest, AStreamParsesAndItsErrorsCarryItsName) {
  std::istringstream good("name: \"piped\"\nsteps: 7\n");
  auto spec = ReadSpecStream(good, "<stdin>");
  ASSERT_TRUE(spec.ok()) << spec.status();
  EXPECT_EQ(spec->name(), "piped");
  EXPECT_EQ(spec->steps(), 7);
  std::istringstream bad("steps: x\n");
  EXPECT_THAT(std::string(ReadSpecStream(bad, "<stdin>").status().message()),
              HasSubstr("<stdin>:1:8: steps (int64): "));
  std::istringstream huge(std::string(kMaxSpecFileBytes + 10, ' '));
  EXPECT_THAT(std::string(ReadSpecStream(huge, "<stdin>").status().message()),
              HasSubstr("<stdin>: larger than"));
}

TEST(SpecFileTest, AValidFileParsesToItsSpec) {
  v1::JobSpec want;
  want.set_name("x");
  want.mutable_model()->set_hidden(64);
  want.mutable_schedule()->mutable_ring_dtp()->set_mode(v1::RingDtpProjection::MODE_WEIGHTS);
  want.mutable_data()->mutable_shards()->add_paths("/a");
  want.mutable_data()->mutable_shards()->add_paths("/b");
  want.set_backend(v1::BACKEND_CPU);
  std::string text;
  google::protobuf::TextFormat::PrintToString(want, &text);
  auto got = ParseSpecText("# the demo\n" + text, "job.txtpb");
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(got->SerializeAsString(), want.SerializeAsString());
}

TEST(SpecFileTest, FilesThatAreNotSpecsAreRefusedNamingThePath) {
  // Run by hand (no TEST_TMPDIR): a directory of this process's own.
  const std::string dir =
      std::getenv("TEST_TMPDIR") ? std::getenv("TEST_TMPDIR") : "/tmp/plateau-test-" + std::to_string(getpid());
  std::filesystem::create_directories(dir);
  EXPECT_THAT(ReadSpecFile(dir + "/missing.txtpb").status().message(),
              HasSubstr("missing.txtpb: cannot open (No such file or directory)"));
  EXPECT_THAT(ReadSpecFile(dir).status().message(), HasSubstr("is a directory"));
  // /dev/zero never ends: refused after the first MiB, not read whole.
  EXPECT_THAT(ReadSpecFile("/dev/zero").status().message(), HasSubstr("/dev/zero: larger than"));
  const std::string bad = dir + "/bad.txtpb";
  std::ofstream(bad) << "steps: 5\nlayout {\n  batch: \"many\"\n}\n";
  EXPECT_THAT(ReadSpecFile(bad).status().message(),
              HasSubstr(bad + ":3:10: layout.batch (int64): Expected integer"));
}

}  // namespace
}  // namespace plateau
