// proto/field_numbers.txt, the ledger of every field and enum value number
// package plateau.v1 has published, against the compiled protos: a number
// is the same field (name and type) as it ever was, or it is reserved with
// its name, so that no number is ever given to another field (data written
// with the old one would read as the new one); and every field and value is
// in the ledger, so that a removal leaves its line behind. The checker is
// tested on protos made up for it first, so that its pass on the real ones
// means something.
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <sstream>
#include <string>
#include <tuple>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "gmock/gmock.h"
#include "google/protobuf/descriptor.h"
#include "google/protobuf/descriptor.pb.h"
#include "google/protobuf/text_format.h"
#include "gtest/gtest.h"
#include "plateau/v1/job.pb.h"
#include "plateau/v1/rpc_status.pb.h"
#include "plateau/v1/worker.pb.h"

namespace plateau {
namespace {

using ::google::protobuf::Descriptor;
using ::google::protobuf::DescriptorPool;
using ::google::protobuf::EnumDescriptor;
using ::google::protobuf::FieldDescriptor;
using ::google::protobuf::FileDescriptor;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::IsEmpty;

// "int64", "optional float", "repeated message:plateau.v1.Placement",
// "enum:plateau.v1.LiveSet": what a field's bytes mean on the wire.
std::string TypeOf(const FieldDescriptor& f) {
  std::string type = f.type_name();
  if (f.message_type() != nullptr) absl::StrAppend(&type, ":", f.message_type()->full_name());
  if (f.enum_type() != nullptr) absl::StrAppend(&type, ":", f.enum_type()->full_name());
  if (f.is_repeated()) return "repeated " + type;
  if (f.has_optional_keyword()) return "optional " + type;
  return type;
}

// One line of the ledger.
struct Entry {
  bool was = false;
  bool field = true;  // else an enum value
  std::string scope;  // the message or enum
  int number = 0;
  std::string name;
  std::string type;  // fields only
  std::string Line() const {
    return absl::StrCat(was ? "was " : "", field ? "field " : "value ", scope, " ", number, " ", name,
                        field ? " " + type : "");
  }
};

// The lines of every field and value of `files` as they are now.
std::vector<Entry> Current(const std::vector<const FileDescriptor*>& files) {
  std::vector<Entry> out;
  std::function<void(const EnumDescriptor&)> add_enum = [&](const EnumDescriptor& e) {
    for (int i = 0; i < e.value_count(); ++i) {
      out.push_back({false, false, e.full_name(), e.value(i)->number(), e.value(i)->name(), ""});
    }
  };
  std::function<void(const Descriptor&)> add_message = [&](const Descriptor& m) {
    for (int i = 0; i < m.field_count(); ++i) {
      const FieldDescriptor& f = *m.field(i);
      out.push_back({false, true, m.full_name(), f.number(), f.name(), TypeOf(f)});
    }
    for (int i = 0; i < m.enum_type_count(); ++i) add_enum(*m.enum_type(i));
    for (int i = 0; i < m.nested_type_count(); ++i) add_message(*m.nested_type(i));
  };
  for (const FileDescriptor* file : files) {
    for (int i = 0; i < file->enum_type_count(); ++i) add_enum(*file->enum_type(i));
    for (int i = 0; i < file->message_type_count(); ++i) add_message(*file->message_type(i));
  }
  return out;
}

// The ledger's lines; a line it cannot read is a problem.
std::vector<Entry> Parse(const std::string& text, std::vector<std::string>* problems) {
  std::vector<Entry> out;
  int at = 0;
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    ++at;
    line = absl::StripAsciiWhitespace(line);
    if (line.empty() || absl::StartsWith(line, "#")) continue;
    Entry e;
    e.was = absl::ConsumePrefix(&line, "was ");
    std::vector<std::string> words = absl::StrSplit(line, ' ', absl::SkipEmpty());
    e.field = !words.empty() && words[0] == "field";
    const bool known = !words.empty() && (words[0] == "field" || words[0] == "value");
    if (!known || words.size() < (e.field ? 5u : 4u) || !absl::SimpleAtoi(words[2], &e.number)) {
      problems->push_back(absl::StrCat("field_numbers.txt:", at,
                                       ": expected 'field <message> <number> <name> "
                                       "<type>' or 'value <enum> <number> <name>', got '",
                                       line, "'"));
      continue;
    }
    e.scope = words[1];
    e.name = words[3];
    if (e.field) e.type = absl::StrJoin(words.begin() + 4, words.end(), " ");
    out.push_back(e);
  }
  return out;
}

// A field retyped on its number before the ledger existed, pinned: its
// `was` line and its line now, as Entry::Line prints them. A `was` line
// excuses that change and no other (job.proto: a type change takes a new
// number).
struct RetypedBeforeTheLedger {
  std::string was;
  std::string now;
};

// The one: OutOfMemory.live_set, a string for 51 minutes (b49ccce), the
// LiveSet enum since 61c459a (2026-12-03); job.proto says why it stayed.
const std::vector<RetypedBeforeTheLedger>& HistoricalRetypes() {
  static const auto* retypes =
      new std::vector<RetypedBeforeTheLedger>{{"was field plateau.v1.OutOfMemory 1 live_set string",
                                               "field plateau.v1.OutOfMemory 1 live_set enum:plateau.v1.LiveSet"}};
  return *retypes;
}

bool Reserved(const DescriptorPool& pool, const Entry& e, bool* scope_exists) {
  if (e.field) {
    const Descriptor* m = pool.FindMessageTypeByName(e.scope);
    *scope_exists = m != nullptr;
    return m != nullptr && m->IsReservedNumber(e.number) && m->IsReservedName(e.name);
  }
  const EnumDescriptor* en = pool.FindEnumTypeByName(e.scope);
  *scope_exists = en != nullptr;
  return en != nullptr && en->IsReservedNumber(e.number) && en->IsReservedName(e.name);
}

// What is wrong between `files` (of `pool`) and the ledger `text`; nothing
// when they agree. `retyped` are the changes on a number a `was` line may
// record (each must keep its `was` line).
std::vector<std::string> Check(const DescriptorPool& pool, const std::vector<const FileDescriptor*>& files,
                               const std::string& text, const std::vector<RetypedBeforeTheLedger>& retyped) {
  std::vector<std::string> problems;
  const std::vector<Entry> ledger = Parse(text, &problems);
  std::set<std::string> was_lines;
  for (const Entry& e : ledger) {
    if (e.was) was_lines.insert(e.Line());
  }
  for (const RetypedBeforeTheLedger& r : retyped) {
    if (was_lines.count(r.was) == 0) {
      problems.push_back(absl::StrCat("'", r.was,
                                      "' is not in proto/field_numbers.txt: the field retyped on its number before "
                                      "the ledger keeps that line (what the number carried first)"));
    }
  }
  using Key = std::tuple<bool, std::string, int>;  // field?, scope, number
  std::map<Key, Entry> now;
  for (const Entry& e : Current(files)) now[{e.field, e.scope, e.number}] = e;
  std::map<Key, const Entry*> listed;  // the ledger's line of each number as it is now
  for (const Entry& e : ledger) {
    if (!e.was) listed[{e.field, e.scope, e.number}] = &e;
  }
  for (const Entry& e : ledger) {
    const Key key{e.field, e.scope, e.number};
    const auto it = now.find(key);
    if (it != now.end() && it->second.name == e.name && it->second.type == e.type) {
      if (e.was) {
        problems.push_back(
            absl::StrCat("'", e.Line(), "': it is the ", e.field ? "field" : "value", " as it is now; drop 'was'"));
      }
      continue;  // the same as ever
    }
    if (e.was && listed.count(key) > 0 && it != now.end()) {
      // What the number carried before; it carries something else now.
      const std::string now_line = it->second.Line();
      bool pinned = false;
      for (const RetypedBeforeTheLedger& r : retyped) pinned = pinned || (r.was == e.Line() && r.now == now_line);
      if (pinned) continue;  // before the ledger (job.proto says why)
      const std::string was_what = e.field ? absl::StrCat(e.name, " ", e.type) : e.name;
      const std::string now_what = e.field ? absl::StrCat(it->second.name, " ", it->second.type) : it->second.name;
      problems.push_back(absl::StrCat(
          e.scope, " number ", e.number, e.field ? " changed type" : " changed", " on its number: it was '", was_what,
          "', it is '", now_what, "'; ",
          e.field ? "a type change takes a new number (data written with the old type would read as the new one)"
                  : "a number is never given to another value",
          ": give the new one a new number and reserve ", e.number, " and \"", e.name,
          "\" (a 'was' line records a change, it does not allow one; only OutOfMemory.live_set, retyped before the "
          "ledger, stays on its number)"));
      continue;
    }
    bool scope_exists = false;
    if (Reserved(pool, e, &scope_exists)) continue;
    if (it != now.end()) {
      problems.push_back(absl::StrCat(e.scope, " number ", e.number, " is now '", it->second.Line(), "' but it was '",
                                      e.Line(), "': a number is never given to another ", e.field ? "field" : "value",
                                      " (data written with the old one "
                                      "would read as the new one); give the new one a new number, and reserve ",
                                      e.number, " and \"", e.name, "\""));
    } else if (scope_exists) {
      problems.push_back(absl::StrCat("'", e.Line(), "' is gone from ", e.scope, " but not reserved: add `reserved ",
                                      e.number, ";` and `reserved \"", e.name, "\";` to it (keep this line)"));
    } else if (!e.was) {
      problems.push_back(absl::StrCat("'", e.Line(), "': ", e.scope, " is gone; mark its lines 'was' (keep them)"));
    }
  }
  for (const auto& [key, e] : now) {
    const auto it = listed.find(key);
    if (it == listed.end()) {
      problems.push_back(absl::StrCat("'", e.Line(), "' is not in proto/field_numbers.txt: add that line"));
    }
  }
  return problems;
}

std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

// The checker on a proto made up for it: the ledger says `Old` had fields
// 1 (id), 2 (size, an int64) and 3 (note), and enum `Color` values 0 and 1.
class CheckerTest : public ::testing::Test {
 protected:
  static constexpr char kLedger[] = R"(# made up
field t.Old 1 id string
field t.Old 2 size int64
field t.Old 3 note string
value t.Color 0 COLOR_UNSPECIFIED
value t.Color 1 RED
)";

  // `old` and `color` are the bodies of message Old and enum Color;
  // `more` is added to the ledger.
  std::vector<std::string> CheckProto(const std::string& old, const std::string& color, const std::string& more = "") {
    const std::string text =
        absl::StrCat(R"(name: "t.proto" package: "t" syntax: "proto3" )", "message_type { name: \"Old\" ", old,
                     " } enum_type { name: \"Color\" ", color, " }");
    google::protobuf::FileDescriptorProto proto;
    EXPECT_TRUE(google::protobuf::TextFormat::ParseFromString(text, &proto)) << text;
    pool_ = std::make_unique<DescriptorPool>();
    const FileDescriptor* file = pool_->BuildFile(proto);
    EXPECT_NE(file, nullptr) << text;
    if (file == nullptr) return {"does not build"};
    return Check(*pool_, {file}, absl::StrCat(kLedger, more), retyped_);
  }

  static constexpr char kId[] = R"(field { name: "id" number: 1 type: TYPE_STRING label: LABEL_OPTIONAL } )";
  static constexpr char kSize[] = R"(field { name: "size" number: 2 type: TYPE_INT64 label: LABEL_OPTIONAL } )";
  static constexpr char kNote[] = R"(field { name: "note" number: 3 type: TYPE_STRING label: LABEL_OPTIONAL } )";
  static constexpr char kColors[] = R"(value { name: "COLOR_UNSPECIFIED" number: 0 } value { name: "RED" number: 1 })";
  std::vector<RetypedBeforeTheLedger> retyped_;  // none unless a test pins one
  std::unique_ptr<DescriptorPool> pool_;
};

TEST_F(CheckerTest, TheProtoAsTheLedgerSaysPasses) {
  EXPECT_THAT(CheckProto(absl::StrCat(kId, kSize, kNote), kColors), IsEmpty());
}

TEST_F(CheckerTest, AFieldRemovedWithoutReservingItsNumberAndNameIsRefused) {
  EXPECT_THAT(CheckProto(absl::StrCat(kId, kSize), kColors),
              ElementsAre(HasSubstr("'field t.Old 3 note string' is gone from t.Old but not reserved: add "
                                    "`reserved 3;` and `reserved \"note\";`")));
  // The number alone is not enough: the name could come back on another.
  EXPECT_THAT(CheckProto(absl::StrCat(kId, kSize, "reserved_range { start: 3 end: 4 }"), kColors),
              ElementsAre(HasSubstr("gone from t.Old but not reserved")));
  EXPECT_THAT(
      CheckProto(absl::StrCat(kId, kSize, R"(reserved_range { start: 3 end: 4 } reserved_name: "note")"), kColors),
      IsEmpty());
}

TEST_F(CheckerTest, ANumberGivenToAnotherFieldOrTypeIsRefused) {
  // Retyped on its number.
  EXPECT_THAT(
      CheckProto(
          absl::StrCat(kId, R"(field { name: "size" number: 2 type: TYPE_STRING label: LABEL_OPTIONAL } )", kNote),
          kColors),
      ElementsAre(HasSubstr("t.Old number 2 is now 'field t.Old 2 size string' but it was 'field t.Old 2 size "
                            "int64': a number is never given to another field")));
  // Reused by another name.
  EXPECT_THAT(CheckProto(absl::StrCat(kId, kSize,
                                      R"(field { name: "label" number: 3 type: TYPE_STRING label: LABEL_OPTIONAL })"),
                         kColors),
              ElementsAre(HasSubstr("t.Old number 3 is now 'field t.Old 3 label string' but it was 'field t.Old 3 "
                                    "note string'")));
  // An enum value too.
  EXPECT_THAT(CheckProto(absl::StrCat(kId, kSize, kNote),
                         R"(value { name: "COLOR_UNSPECIFIED" number: 0 } value { name: "BLUE" number: 1 })"),
              ElementsAre(HasSubstr("t.Color number 1 is now 'value t.Color 1 BLUE' but it was 'value t.Color 1 "
                                    "RED'")));
}

TEST_F(CheckerTest, AFieldAddedWithoutItsLineIsNamed) {
  EXPECT_THAT(
      CheckProto(absl::StrCat(kId, kSize, kNote,
                              R"(field { name: "tags" number: 4 type: TYPE_STRING label: LABEL_REPEATED })"),
                 kColors),
      ElementsAre(HasSubstr("'field t.Old 4 tags repeated string' is not in proto/field_numbers.txt: add that line")));
}

// A `was` line says what a number carried before. A field whose type
// changed on its number (size: a string once, an int64 now) is refused
// like any retype, `was` line or not: a type change takes a new number
// (job.proto), and data written with the old type reads as the new one.
TEST_F(CheckerTest, AWasLineDoesNotExcuseARetype) {
  const std::string fields = absl::StrCat(kId, kSize, kNote);
  EXPECT_THAT(CheckProto(fields, kColors, "was field t.Old 2 size string\n"),
              ElementsAre(HasSubstr("t.Old number 2 changed type on its number: it was 'size string', it is "
                                    "'size int64'; a type change takes a new number")));
  // An enum value renamed on its number, likewise.
  EXPECT_THAT(CheckProto(fields, kColors, "was value t.Color 1 ROUGE\n"),
              ElementsAre(HasSubstr("t.Color number 1 changed on its number: it was 'ROUGE', it is 'RED'")));
}

// The exemption is pinned: the `was` line and the field as it is now. It
// excuses that change, not the same number retyped again, and a ledger
// that lost its `was` line is named.
TEST_F(CheckerTest, OnlyThePinnedRetypeIsExcused) {
  const std::string fields = absl::StrCat(kId, kSize, kNote);
  retyped_ = {{"was field t.Old 2 size string", "field t.Old 2 size int64"}};
  EXPECT_THAT(CheckProto(fields, kColors, "was field t.Old 2 size string\n"), IsEmpty());
  // Retyped again (int64 -> uint64), its ledger line following: refused.
  const std::string size_u64 = R"(field { name: "size" number: 2 type: TYPE_UINT64 label: LABEL_OPTIONAL } )";
  const std::string ledger_u64 = R"(field t.Old 1 id string
field t.Old 2 size uint64
field t.Old 3 note string
value t.Color 0 COLOR_UNSPECIFIED
value t.Color 1 RED
was field t.Old 2 size string
)";
  google::protobuf::FileDescriptorProto proto;
  ASSERT_TRUE(google::protobuf::TextFormat::ParseFromString(
      absl::StrCat(R"(name: "t.proto" package: "t" syntax: "proto3" message_type { name: "Old" )", kId, size_u64, kNote,
                   R"( } enum_type { name: "Color" )", kColors, " }"),
      &proto));
  DescriptorPool pool;
  const FileDescriptor* file = pool.BuildFile(proto);
  ASSERT_NE(file, nullptr);
  EXPECT_THAT(Check(pool, {file}, ledger_u64, retyped_),
              ElementsAre(HasSubstr("t.Old number 2 changed type on its number: it was 'size string', it is "
                                    "'size uint64'")));
  // The pinned line dropped from the ledger.
  EXPECT_THAT(CheckProto(fields, kColors),
              ElementsAre(HasSubstr("'was field t.Old 2 size string' is not in proto/field_numbers.txt: the field "
                                    "retyped on its number before the ledger keeps that line")));
}

// A stale `was` (the field as it is now) is named; so is a message gone
// from the protos whose lines are not marked `was`, and once marked they
// pass (a number of a message that no longer exists is given to nothing).
TEST_F(CheckerTest, AStaleOrMissingWasIsNamed) {
  const std::string fields = absl::StrCat(kId, kSize, kNote);
  EXPECT_THAT(CheckProto(fields, kColors, "was field t.Old 3 note string\n"),
              ElementsAre(HasSubstr("'was field t.Old 3 note string': it is the field as it is now; drop 'was'")));
  EXPECT_THAT(CheckProto(fields, kColors, "field t.Gone 1 id string\nvalue t.Shade 0 SHADE_UNSPECIFIED\n"),
              ElementsAre(HasSubstr("'field t.Gone 1 id string': t.Gone is gone; mark its lines 'was' (keep them)"),
                          HasSubstr("'value t.Shade 0 SHADE_UNSPECIFIED': t.Shade is gone; mark its lines 'was'")));
  EXPECT_THAT(CheckProto(fields, kColors, "was field t.Gone 1 id string\nwas value t.Shade 0 SHADE_UNSPECIFIED\n"),
              IsEmpty());
}

// The real protos against the real ledger.
TEST(FieldNumbersTest, EveryNumberPlateauV1EverPublishedIsTheSameFieldOrReserved) {
  const std::string ledger = ReadFile("proto/field_numbers.txt");
  ASSERT_FALSE(ledger.empty()) << "proto/field_numbers.txt is missing from the test's data";
  const std::vector<const FileDescriptor*> files = {
      v1::Job::descriptor()->file(), v1::RegisterRequest::descriptor()->file(), v1::RpcStatus::descriptor()->file()};
  const std::vector<std::string> problems =
      Check(*DescriptorPool::generated_pool(), files, ledger, HistoricalRetypes());
  EXPECT_THAT(problems, IsEmpty()) << absl::StrJoin(problems, "\n");
}

// The one field retyped on its number (before the ledger): it stays the
// LiveSet enum on 1 (job.proto's comment says why). A second change of
// its type takes a new number.
TEST(FieldNumbersTest, OutOfMemoryLiveSetStaysTheLiveSetEnumOnOne) {
  const FieldDescriptor* f = v1::OutOfMemory::descriptor()->FindFieldByNumber(1);
  ASSERT_NE(f, nullptr);
  EXPECT_EQ(f->name(), "live_set");
  EXPECT_EQ(TypeOf(*f), "enum:plateau.v1.LiveSet");
}

}  // namespace
}  // namespace plateau
