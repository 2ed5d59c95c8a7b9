#include "tests/spec_fuzz.h"

#include <cmath>
#include <limits>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "client/spec_file.h"
#include "google/protobuf/descriptor.h"
#include "google/protobuf/text_format.h"
#include "worker/job_spec.h"

namespace plateau {
namespace spec_fuzz {
namespace {

namespace pb = google::protobuf;

constexpr int64_t kI64Max = std::numeric_limits<int64_t>::max();
constexpr int64_t kI64Min = std::numeric_limits<int64_t>::min();

// Every field of JobSpec and its sub-messages, as paths from JobSpec.
using FieldPath = std::vector<const pb::FieldDescriptor*>;
void CollectFields(const pb::Descriptor* d, FieldPath* prefix, std::vector<FieldPath>* out) {
  for (int i = 0; i < d->field_count(); ++i) {
    const pb::FieldDescriptor* f = d->field(i);
    prefix->push_back(f);
    out->push_back(*prefix);
    if (f->message_type() != nullptr && !f->is_repeated() && prefix->size() < 4) {
      CollectFields(f->message_type(), prefix, out);
    }
    prefix->pop_back();
  }
}

const std::vector<FieldPath>& AllFields() {
  static const std::vector<FieldPath>* all = [] {
    auto* out = new std::vector<FieldPath>;
    FieldPath prefix;
    CollectFields(v1::JobSpec::descriptor(), &prefix, out);
    return out;
  }();
  return *all;
}

std::string PathName(const FieldPath& p) {
  std::string out;
  for (const auto* f : p) absl::StrAppend(&out, out.empty() ? "" : ".", f->name());
  return out;
}

}  // namespace

const char* KindName(SpecMutator::Kind kind) {
  switch (kind) {
    case SpecMutator::Kind::kRandomBytes:
      return "random bytes";
    case SpecMutator::Kind::kWireEdit:
      return "wire edit";
    case SpecMutator::Kind::kTextEdit:
      return "text edit";
    case SpecMutator::Kind::kFieldValues:
      return "field values";
  }
  return "?";
}

std::vector<v1::JobSpec> ValidSeeds() {
  std::vector<v1::JobSpec> seeds;
  seeds.push_back(DemoJobSpec(2, 200));
  v1::JobSpec ring = DemoJobSpec(2, 50);
  ring.set_name("ring");
  auto* r = ring.mutable_schedule()->mutable_ring_dtp();
  r->set_mode(v1::RingDtpProjection::MODE_ACTIVATIONS);
  r->set_strip(8);
  r->set_row_tile(64);
  r->set_chunk_rows(128);
  ring.mutable_checkpoint()->set_directory("/tmp/ckpt");
  ring.mutable_checkpoint()->set_every(10);
  ring.set_max_restarts(2);
  ring.set_seed(7);
  ring.mutable_optimizer()->set_beta1(0.8f);
  ring.mutable_optimizer()->set_weight_decay(0.1f);
  ring.mutable_model()->set_rope_theta(500000);
  seeds.push_back(ring);
  v1::JobSpec text = DemoJobSpec(1, 10);
  text.set_name("text");
  text.mutable_model()->set_vocab_size(256);
  text.mutable_data()->mutable_text()->set_path("/data/corpus.txt");
  text.set_backend(v1::BACKEND_CUDA);
  text.set_device_memory_bytes(0);
  seeds.push_back(text);
  return seeds;
}

SpecMutator::SpecMutator(uint64_t seed) : rng_(seed), seeds_(ValidSeeds()) {}

SpecMutator::Input SpecMutator::Next() {
  // Most inputs are near-valid: they reach the validator's deeper checks.
  const uint64_t r = Below(10);
  const Kind kind = r == 0 ? Kind::kRandomBytes : r < 3 ? Kind::kWireEdit : r < 5 ? Kind::kTextEdit : Kind::kFieldValues;
  return Next(kind);
}

SpecMutator::Input SpecMutator::Next(Kind kind) {
  Input in{kind, "", {}, ""};
  const v1::JobSpec& base = seeds_[Below(seeds_.size())];
  switch (kind) {
    case Kind::kRandomBytes:
      in.bytes = RandomBytes(Below(8) == 0 ? 4096 : 256);
      in.what = absl::StrCat(in.bytes.size(), " random bytes");
      break;
    case Kind::kWireEdit:
      in.bytes = EditWire(base.SerializeAsString(), &in.what);
      break;
    case Kind::kTextEdit: {
      std::string text;
      pb::TextFormat::PrintToString(base, &text);
      in.bytes = EditText(text, &in.what);
      break;
    }
    case Kind::kFieldValues:
      in.spec = MutateFields(&in.what);
      break;
  }
  return in;
}

std::string SpecMutator::RandomBytes(size_t max_len) {
  std::string s(Below(max_len + 1), '\0');
  for (char& c : s) c = static_cast<char>(rng_());
  return s;
}

std::string SpecMutator::EditWire(std::string b, std::string* what) {
  const int edits = 1 + static_cast<int>(Below(3));
  for (int e = 0; e < edits; ++e) {
    const size_t n = b.size();
    switch (Below(7)) {
      case 0: {  // bit flips
        if (n == 0) break;
        const int flips = 1 + static_cast<int>(Below(8));
        for (int i = 0; i < flips; ++i) b[Below(n)] ^= static_cast<char>(1u << Below(8));
        absl::StrAppend(what, "flip ", flips, " bits; ");
        break;
      }
      case 1: {  // a byte set to a boundary value
        if (n == 0) break;
        static const unsigned char kBytes[] = {0x00, 0x01, 0x7f, 0x80, 0xff, 0x08, 0x0a, 0x12};
        const size_t at = Below(n);
        b[at] = static_cast<char>(kBytes[Below(sizeof(kBytes))]);
        absl::StrAppend(what, "set byte ", at, "; ");
        break;
      }
      case 2: {  // truncation
        const size_t at = Below(n + 1);
        b.resize(at);
        absl::StrAppend(what, "truncate at ", at, "; ");
        break;
      }
      case 3: {  // a duplicated segment (duplicated fields when it falls on field bounds)
        if (n == 0) break;
        const size_t from = Below(n), len = 1 + Below(n - from), to = Below(n + 1);
        b.insert(to, b.substr(from, len));
        absl::StrAppend(what, "duplicate [", from, ", +", len, ") at ", to, "; ");
        break;
      }
      case 4: {  // another seed's whole serialization appended: every field repeated
        b += seeds_[Below(seeds_.size())].SerializeAsString();
        absl::StrAppend(what, "append a seed; ");
        break;
      }
      case 5: {  // random bytes inserted
        const size_t at = Below(n + 1);
        b.insert(at, RandomBytes(16));
        absl::StrAppend(what, "insert random at ", at, "; ");
        break;
      }
      default: {  // a deleted segment
        if (n == 0) break;
        const size_t from = Below(n), len = 1 + Below(std::min<size_t>(n - from, 16));
        b.erase(from, len);
        absl::StrAppend(what, "delete [", from, ", +", len, "); ");
        break;
      }
    }
  }
  return b;
}

std::string SpecMutator::EditText(std::string t, std::string* what) {
  static const char* kLiterals[] = {"0",    "-1",   "99999999999999999999", "-9223372036854775808",
                                    "9223372036854775807", "2147483648", "nan", "inf", "-inf", "1e40",
                                    "0x7fffffffffffffff", "\"str\"", "BACKEND_TPU", "-0", "1.5", "{", "}",
                                    "", "x", "[\"/a\", 5]", "1e-45", "0.9999999", "true"};
  const int edits = 1 + static_cast<int>(Below(3));
  for (int e = 0; e < edits; ++e) {
    const size_t n = t.size();
    switch (Below(6)) {
      case 0: {  // a number (or the value after a ':') replaced by a boundary literal
        std::vector<size_t> colons;
        for (size_t i = 0; i < n; ++i) {
          if (t[i] == ':') colons.push_back(i);
        }
        if (colons.empty()) break;
        const size_t c = colons[Below(colons.size())] + 1;
        size_t end = c;
        while (end < n && t[end] == ' ') ++end;
        while (end < n && t[end] != '\n' && t[end] != ' ') ++end;
        const char* lit = kLiterals[Below(sizeof(kLiterals) / sizeof(kLiterals[0]))];
        t.replace(c, end - c, absl::StrCat(" ", lit));
        absl::StrAppend(what, "value at ", c, " := ", lit, "; ");
        break;
      }
      case 1: {  // a character deleted
        if (n == 0) break;
        const size_t at = Below(n);
        t.erase(at, 1);
        absl::StrAppend(what, "delete char ", at, "; ");
        break;
      }
      case 2: {  // a character of the format's syntax inserted
        static const char kChars[] = "{}[]<>:;,\"'#-.0123456789eExXabz_ \n\\";
        const size_t at = Below(n + 1);
        t.insert(at, 1, kChars[Below(sizeof(kChars) - 1)]);
        absl::StrAppend(what, "insert char at ", at, "; ");
        break;
      }
      case 3: {  // a line duplicated (duplicated fields)
        std::vector<std::string> lines = absl::StrSplit(t, '\n');
        const size_t i = Below(lines.size());
        lines.insert(lines.begin() + static_cast<long>(i), lines[i]);
        t = absl::StrJoin(lines, "\n");
        absl::StrAppend(what, "duplicate line ", i, "; ");
        break;
      }
      case 4: {  // truncation
        const size_t at = Below(n + 1);
        t.resize(at);
        absl::StrAppend(what, "truncate at ", at, "; ");
        break;
      }
      default: {  // a random byte
        if (n == 0) break;
        const size_t at = Below(n);
        t[at] = static_cast<char>(rng_());
        absl::StrAppend(what, "random byte at ", at, "; ");
        break;
      }
    }
  }
  return t;
}

v1::JobSpec SpecMutator::MutateFields(std::string* what) {
  v1::JobSpec spec = seeds_[Below(seeds_.size())];
  const int n = 1 + static_cast<int>(Below(3));
  for (int k = 0; k < n; ++k) {
    const FieldPath& path = AllFields()[Below(AllFields().size())];
    pb::Message* m = &spec;
    for (size_t i = 0; i + 1 < path.size(); ++i) m = m->GetReflection()->MutableMessage(m, path[i]);
    const pb::FieldDescriptor* f = path.back();
    const pb::Reflection* r = m->GetReflection();
    absl::StrAppend(what, PathName(path), " := ");
    if (Below(8) == 0) {
      r->ClearField(m, f);
      absl::StrAppend(what, "(cleared); ");
      continue;
    }
    // Near the current value half the time: those stay near-valid.
    auto int_value = [&](int64_t current) -> int64_t {
      static const int64_t kInts[] = {0, 1, -1, 2, 3, 4, 7, 8, 16, 31, 32, 33, 64, 100, 1000, 4096,
                                      int64_t{1} << 20, (int64_t{1} << 20) + 1, int64_t{1} << 31,
                                      (int64_t{1} << 31) + 1, int64_t{1} << 40, int64_t{1} << 62,
                                      kI64Max, kI64Min, kI64Min + 1};
      // Wrapping arithmetic: the mutator itself must not overflow (UBSan).
      const uint64_t u = static_cast<uint64_t>(current);
      switch (Below(4)) {
        case 0:
          return static_cast<int64_t>(u + Below(7) - 3);
        case 1:
          return Below(2) ? static_cast<int64_t>(u * 2) : current / 2;
        case 2: {
          const int64_t p = int64_t{1} << Below(63);
          return p + static_cast<int64_t>(Below(3)) - 1;
        }
        default:
          return kInts[Below(sizeof(kInts) / sizeof(kInts[0]))];
      }
    };
    auto float_value = [&](double current) -> double {
      static const double kFloats[] = {0.0, -0.0, 1.0, -1.0, std::nan(""), INFINITY, -INFINITY, 1e-45,
                                       3.4e38, 1e30, 0.5, 0.999, 1.0001, 1e-8, 2.0, 1e12, 1e13};
      if (Below(2)) return current * (Below(2) ? 0.5 : 2.0);
      return kFloats[Below(sizeof(kFloats) / sizeof(kFloats[0]))];
    };
    switch (f->cpp_type()) {
      case pb::FieldDescriptor::CPPTYPE_INT64: {
        const int64_t v = int_value(r->GetInt64(*m, f));
        r->SetInt64(m, f, v);
        absl::StrAppend(what, v, "; ");
        break;
      }
      case pb::FieldDescriptor::CPPTYPE_INT32: {
        const int32_t v = static_cast<int32_t>(int_value(r->GetInt32(*m, f)));
        r->SetInt32(m, f, v);
        absl::StrAppend(what, v, "; ");
        break;
      }
      case pb::FieldDescriptor::CPPTYPE_UINT64: {
        const uint64_t v = static_cast<uint64_t>(int_value(static_cast<int64_t>(r->GetUInt64(*m, f))));
        r->SetUInt64(m, f, v);
        absl::StrAppend(what, v, "; ");
        break;
      }
      case pb::FieldDescriptor::CPPTYPE_UINT32: {
        const uint32_t v = static_cast<uint32_t>(int_value(r->GetUInt32(*m, f)));
        r->SetUInt32(m, f, v);
        absl::StrAppend(what, v, "; ");
        break;
      }
      case pb::FieldDescriptor::CPPTYPE_FLOAT: {
        const float v = static_cast<float>(float_value(r->GetFloat(*m, f)));
        r->SetFloat(m, f, v);
        absl::StrAppend(what, v, "; ");
        break;
      }
      case pb::FieldDescriptor::CPPTYPE_DOUBLE: {
        const double v = float_value(r->GetDouble(*m, f));
        r->SetDouble(m, f, v);
        absl::StrAppend(what, v, "; ");
        break;
      }
      case pb::FieldDescriptor::CPPTYPE_ENUM: {
        static const int kEnums[] = {-1, 0, 1, 2, 3, 7, std::numeric_limits<int>::max()};
        const int v = kEnums[Below(sizeof(kEnums) / sizeof(kEnums[0]))];
        r->SetEnumValue(m, f, v);
        absl::StrAppend(what, v, "; ");
        break;
      }
      case pb::FieldDescriptor::CPPTYPE_STRING: {
        static const std::string kStrings[] = {"", "/tmp/x", "relative/path", "/" + std::string(5000, 'a'),
                                               std::string("/a\0b", 4), "\xff\xfe", std::string(300, 'n')};
        std::string v = kStrings[Below(sizeof(kStrings) / sizeof(kStrings[0]))];
        if (Below(4) == 0) v = RandomBytes(32);
        if (f->is_repeated()) {
          r->AddString(m, f, v);
        } else {
          r->SetString(m, f, v);
        }
        absl::StrAppend(what, "'", absl::CHexEscape(v.substr(0, 16)), "'; ");
        break;
      }
      case pb::FieldDescriptor::CPPTYPE_MESSAGE:
        if (f->is_map()) {
          // One more entry (JobSpec.labels): keys and values valid, near
          // the rules' edges, or random bytes.
          static const std::string kLabelTexts[] = {"team", "", "-x", "a/b", "example.com/owner", "A.b_c-9",
                                                    std::string(63, 'k'), std::string(64, 'k'), "nl p", "\xff"};
          pb::Message* entry = r->AddMessage(m, f);
          std::string text[2];
          for (int side = 0; side < 2; ++side) {
            text[side] = Below(4) == 0 ? RandomBytes(8) : kLabelTexts[Below(sizeof(kLabelTexts) / sizeof(kLabelTexts[0]))];
            entry->GetReflection()->SetString(entry, entry->GetDescriptor()->field(side), text[side]);
          }
          absl::StrAppend(what, "+{'", absl::CHexEscape(text[0].substr(0, 16)), "': '",
                          absl::CHexEscape(text[1].substr(0, 16)), "'}; ");
          break;
        }
        // Present and empty: a oneof switches to it; a sub-message loses its fields.
        r->ClearField(m, f);
        r->MutableMessage(m, f);
        absl::StrAppend(what, "{}; ");
        break;
      case pb::FieldDescriptor::CPPTYPE_BOOL:
        r->SetBool(m, f, !r->GetBool(*m, f));
        absl::StrAppend(what, "flipped; ");
        break;
    }
  }
  return spec;
}

bool NamesAField(absl::string_view message) {
  const size_t colon = message.find(": ");
  if (colon == absl::string_view::npos || colon == 0) return false;
  // "spec: ..." is about the spec as a whole (a field number this build
  // does not know, at the top level).
  if (message.substr(0, colon) == "spec") return true;
  const pb::Descriptor* d = v1::JobSpec::descriptor();
  for (absl::string_view part : absl::StrSplit(message.substr(0, colon), '.')) {
    if (d == nullptr) return false;  // a path below a scalar
    const size_t bracket = part.find('[');
    bool repeated_index = false;
    if (bracket != absl::string_view::npos) {  // "paths[3]"
      int64_t i = 0;
      if (!absl::EndsWith(part, "]") ||
          !absl::SimpleAtoi(part.substr(bracket + 1, part.size() - bracket - 2), &i) || i < 0) {
        return false;
      }
      part = part.substr(0, bracket);
      repeated_index = true;
    }
    const pb::FieldDescriptor* f = d->FindFieldByName(std::string(part));
    if (f == nullptr || (repeated_index && !f->is_repeated())) return false;
    d = f->message_type();
  }
  return true;
}

std::string CheckSpec(const v1::JobSpec& spec, bool* accepted) {
  const absl::Status v = ValidateJobSpec(spec);
  const absl::StatusOr<v1::MemoryPlan> p = PlanJob(spec);
  const absl::StatusOr<v1::MemoryPlan> a = AdmitJob(spec);
  if (accepted != nullptr) *accepted = v.ok();
  // bf16 on a shape the bf16 step cannot take is planned (what it would
  // need) but never run (CheckBf16Schedules: model.experts above
  // model.hidden). Every schedule computes bf16, so no schedule field is
  // refused for it.
  const bool planned_not_run = spec.precision() == v1::PRECISION_BF16 &&
                               absl::StartsWith(v.message(), "model.experts: ") &&
                               absl::StrContains(v.message(), "under precision bf16");
  if (planned_not_run) {
    if (!p.ok()) return absl::StrCat("PlanJob refused a bf16 spec it should plan: ", p.status().ToString());
    if (a.status() != v) return absl::StrCat("AdmitJob says ", a.status().ToString(), " but ValidateJobSpec ", v.ToString());
    return "";
  }
  if (p.status() != v) return absl::StrCat("PlanJob says ", p.status().ToString(), " but ValidateJobSpec ", v.ToString());
  if (!v.ok()) {
    if (v.code() != absl::StatusCode::kInvalidArgument && v.code() != absl::StatusCode::kUnimplemented) {
      return absl::StrCat("refused with an unexpected code: ", v.ToString());
    }
    if (!NamesAField(v.message())) return absl::StrCat("the refusal does not start with a field: ", v.ToString());
    if (a.status() != v) return absl::StrCat("AdmitJob says ", a.status().ToString(), " but ValidateJobSpec ", v.ToString());
    return "";
  }
  if (!a.ok() && (a.status().code() != absl::StatusCode::kResourceExhausted ||
                  !(absl::StartsWith(a.status().message(), "device_memory_bytes: ") ||
                    absl::StartsWith(a.status().message(), "host_memory_bytes: ")))) {
    return absl::StrCat("AdmitJob refused a valid spec unexpectedly: ", a.status().ToString());
  }
  int64_t sum = 0;
  for (const v1::LiveSetBytes& ls : p->live_sets()) {
    if (ls.bytes() < 0) return absl::StrCat("live set ", ls.live_set(), " planned negative: ", ls.bytes());
    if (ls.bytes() > std::numeric_limits<int64_t>::max() - sum) return "the live sets' sum overflows";
    sum += ls.bytes();
  }
  if (sum != p->total_bytes()) return absl::StrCat("live sets sum to ", sum, ", total_bytes says ", p->total_bytes());
  int64_t host = 0;
  for (const v1::LiveSetBytes& ls : p->host_live_sets()) {
    if (ls.bytes() < 0) return absl::StrCat("host live set ", ls.live_set(), " planned negative: ", ls.bytes());
    if (ls.bytes() > std::numeric_limits<int64_t>::max() - host) return "the host live sets' sum overflows";
    host += ls.bytes();
  }
  if (host != p->host_total_bytes()) {
    return absl::StrCat("host live sets sum to ", host, ", host_total_bytes says ", p->host_total_bytes());
  }
  if (p->parameters() <= 0 || p->active_parameters() <= 0 || p->active_parameters() > p->parameters() ||
      p->tokens_per_rank() <= 0 || !(p->model_flops_per_step() > 0)) {
    return absl::StrCat("implausible plan: ", p->ShortDebugString());
  }
  // Accepted specs re-validate after the round trips the service makes: the
  // wire (SubmitJob, SQLite, the assignment) and the text format (plateauctl).
  v1::JobSpec wire;
  if (!wire.ParseFromString(spec.SerializeAsString())) return "an accepted spec does not re-parse";
  if (absl::Status w = ValidateJobSpec(wire); !w.ok()) return absl::StrCat("after the wire: ", w.ToString());
  v1::JobSpec known = spec;
  known.DiscardUnknownFields();  // the text format cannot carry fields it does not know
  std::string text;
  if (!pb::TextFormat::PrintToString(known, &text)) return "an accepted spec does not print";
  auto back = ParseSpecText(text, "roundtrip.txtpb");
  if (!back.ok()) return absl::StrCat("its text format does not parse: ", back.status().ToString());
  if (absl::Status t = ValidateJobSpec(*back); !t.ok()) return absl::StrCat("after the text format: ", t.ToString());
  auto p2 = PlanJob(*back);
  if (!p2.ok() || p2->total_bytes() != p->total_bytes()) return "the text format's plan differs";
  return "";
}

std::string CheckBytes(absl::string_view data, int* accepted) {
  int ok = 0;
  if (accepted == nullptr) accepted = &ok;
  *accepted = 0;
  bool yes = false;
  v1::JobSpec wire;
  if (wire.ParseFromArray(data.data(), static_cast<int>(data.size()))) {
    std::string r = CheckSpec(wire, &yes);
    *accepted += yes;
    if (!r.empty()) return absl::StrCat("wire: ", r);
  }
  auto text = ParseSpecText(data, "fuzz.txtpb");
  if (text.ok()) {
    std::string r = CheckSpec(*text, &yes);
    *accepted += yes;
    if (!r.empty()) return absl::StrCat("text: ", r);
  } else {
    // "fuzz.txtpb:LINE:COLUMN: ..." or, for what the parser could not place, ": cannot be parsed"
    std::vector<absl::string_view> parts = absl::StrSplit(text.status().message(), absl::MaxSplits(':', 3));
    int line = 0, column = 0;
    if (text.status().code() != absl::StatusCode::kInvalidArgument || parts.size() < 4 ||
        parts[0] != "fuzz.txtpb" || !absl::SimpleAtoi(parts[1], &line) || !absl::SimpleAtoi(parts[2], &column) ||
        line < 1 || column < 1) {
      return absl::StrCat("text: the parse error does not name a place: ", text.status().ToString());
    }
  }
  return "";
}

}  // namespace spec_fuzz
}  // namespace plateau
