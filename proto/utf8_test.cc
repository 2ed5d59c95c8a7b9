#include "proto/utf8.h"

#include <string>

#include "gtest/gtest.h"
#include "plateau/v1/worker.pb.h"

namespace plateau {
namespace {

const std::string kFffd = "\xEF\xBF\xBD";

TEST(Utf8Test, WellFormedSequencesAreValidAndKept) {
  for (const std::string& s :
       {std::string(""), std::string("ascii"), std::string("caf\xC3\xA9"), std::string("\xE2\x96\x88 bar"),
        std::string("\xF0\x9F\x98\x80"), std::string("\xF4\x8F\xBF\xBF"), std::string("nul\0in", 6)}) {
    EXPECT_TRUE(IsValidUtf8(s)) << s;
    EXPECT_EQ(ToValidUtf8(s), s);
  }
}

// Table 3-7's edges: each of these is one or more ill-formed bytes, and
// each such byte becomes one U+FFFD.
TEST(Utf8Test, IllFormedBytesBecomeReplacementCharacters) {
  struct Case {
    std::string in, out;
  };
  const Case cases[] = {
      {"caf\xE9", "caf" + kFffd},                            // Latin-1
      {"\xFF\xFE", kFffd + kFffd},                           // never in UTF-8
      {"\x80", kFffd},                                       // a lone continuation
      {"\xC0\xAF", kFffd + kFffd},                           // overlong '/'
      {"\xC1\xBF", kFffd + kFffd},                           // overlong
      {"\xE0\x9F\xBF", kFffd + kFffd + kFffd},               // overlong 3-byte
      {"\xED\xA0\x80", kFffd + kFffd + kFffd},               // a surrogate
      {"\xF0\x8F\xBF\xBF", kFffd + kFffd + kFffd + kFffd},   // overlong 4-byte
      {"\xF4\x90\x80\x80", kFffd + kFffd + kFffd + kFffd},   // past U+10FFFF
      {"\xF5\x80\x80\x80", kFffd + kFffd + kFffd + kFffd},   // past U+10FFFF
      {"a\xE2\x96", "a" + kFffd + kFffd},                    // cut short at the end
      {std::string("\xE2\x96") + "b", kFffd + kFffd + "b"},  // cut short before ASCII
  };
  for (const Case& c : cases) {
    EXPECT_FALSE(IsValidUtf8(c.in)) << c.in;
    const std::string fixed = ToValidUtf8(c.in);
    EXPECT_EQ(fixed, c.out) << c.in;
    EXPECT_TRUE(IsValidUtf8(fixed));
  }
}

TEST(Utf8Test, APrefixNeverSplitsACharacter) {
  const std::string bar = "\xE2\x96\x88";  // U+2588, three bytes
  std::string s;
  for (int i = 0; i < 10; ++i) s += bar;
  for (size_t max = 0; max <= s.size() + 1; ++max) {
    const absl::string_view p = Utf8Prefix(s, max);
    EXPECT_EQ(p.size(), std::min(s.size(), max / 3 * 3)) << max;
    EXPECT_TRUE(IsValidUtf8(p)) << max;
  }
  EXPECT_EQ(Utf8Prefix("abc", 2), "ab");
}

// What the agent sends: a batch whose log line and rank error are not
// UTF-8 is made to parse on the coordinator, nested and repeated fields too.
TEST(Utf8Test, EveryStringOfAMessageIsMadeValidAndTheMessageParses) {
  v1::TelemetryRequest req;
  req.set_worker_id("worker-1");
  v1::LogEntry* good = req.add_logs();
  good->set_line("caf\xC3\xA9");
  v1::LogEntry* bad = req.add_logs();
  bad->set_line("caf\xE9 \xFF");
  bad->set_stream("stdout");
  const std::string wire = req.SerializeAsString();
  v1::TelemetryRequest parsed;
  ASSERT_FALSE(parsed.ParseFromString(wire)) << "protobuf took invalid UTF-8: this file's reason is gone";

  EXPECT_EQ(MakeStringsValidUtf8(req), 1);
  EXPECT_EQ(req.logs(0).line(), "caf\xC3\xA9");
  EXPECT_EQ(req.logs(1).line(), "caf" + kFffd + " " + kFffd);
  ASSERT_TRUE(parsed.ParseFromString(req.SerializeAsString()));
  EXPECT_EQ(parsed.logs(1).line(), req.logs(1).line());
  EXPECT_EQ(MakeStringsValidUtf8(req), 0);

  // A rank's exit with an error naming a Latin-1 path: inside a oneof.
  v1::RankStatusRequest exited;
  exited.mutable_exited()->set_message("cannot open /data/caf\xE9.bin");
  EXPECT_EQ(MakeStringsValidUtf8(exited), 1);
  EXPECT_EQ(exited.exited().message(), "cannot open /data/caf" + kFffd + ".bin");
  EXPECT_TRUE(v1::RankStatusRequest().ParseFromString(exited.SerializeAsString()));
}

// C0 (tab and newline too), DEL, and C1 as UTF-8 (C2 80..C2 9F); 0xC2
// before an ASCII byte is invalid UTF-8, not a control character (it was
// taken for one, which printed "\xC2A" as \u0041 and lost the A).
TEST(Utf8Test, FirstControlCharacterFindsC0DelAndC1Only) {
  EXPECT_EQ(FirstControlCharacter("plain text"), 10u);
  EXPECT_EQ(FirstControlCharacter("a\tb"), 1u);
  EXPECT_EQ(FirstControlCharacter("ab\x7f"), 2u);
  EXPECT_EQ(FirstControlCharacter("x\xc2\x9b"
                                  "1m"),
            1u);
  EXPECT_EQ(FirstControlCharacter("x\xc2\x80"), 1u);
  EXPECT_EQ(FirstControlCharacter("caf\xc3\xa9 \xc2\xa0"), 8u);  // e-acute, no-break space: printable
  EXPECT_EQ(FirstControlCharacter("\xc2"
                                  "A"),
            2u);
  EXPECT_EQ(FirstControlCharacter("\xc2\t"), 1u);  // the tab, not the C2
  EXPECT_EQ(FirstControlCharacter("end\xc2"), 4u);
}

}  // namespace
}  // namespace plateau
