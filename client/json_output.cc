#include "client/json_output.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "google/protobuf/descriptor.h"
#include "google/protobuf/timestamp.pb.h"
#include "google/protobuf/util/time_util.h"

namespace plateau {
namespace {

using google::protobuf::FieldDescriptor;
using google::protobuf::Message;
using google::protobuf::Reflection;

// 2^53: every integer of smaller magnitude is a double exactly.
constexpr int64_t kSafeInteger = int64_t{1} << 53;

std::string Int64(int64_t v) {
  if (v > -kSafeInteger && v < kSafeInteger) return absl::StrCat(v);
  return absl::StrCat("\"", v, "\"");
}

std::string UInt64(uint64_t v) {
  if (v < static_cast<uint64_t>(kSafeInteger)) return absl::StrCat(v);
  return absl::StrCat("\"", v, "\"");
}

std::string Double(double v) {
  if (std::isnan(v)) return "\"NaN\"";
  if (std::isinf(v)) return v > 0 ? "\"Infinity\"" : "\"-Infinity\"";
  // %.17g reads back as the same double; JSON has no "-0" trouble.
  return absl::StrFormat("%.17g", v);
}

std::string Float(float v) {
  if (std::isnan(v) || std::isinf(v)) return Double(v);
  return absl::StrFormat("%.9g", v);  // reads back as the same float
}

void AppendMessage(const Message& m, std::string* out);

// One value of `f` (element `index` when repeated, -1 otherwise).
void AppendValue(const Message& m, const FieldDescriptor* f, int index, std::string* out) {
  const Reflection* r = m.GetReflection();
  const bool rep = index >= 0;
  switch (f->cpp_type()) {
    case FieldDescriptor::CPPTYPE_INT32:
      absl::StrAppend(out, rep ? r->GetRepeatedInt32(m, f, index) : r->GetInt32(m, f));
      break;
    case FieldDescriptor::CPPTYPE_UINT32:
      absl::StrAppend(out, rep ? r->GetRepeatedUInt32(m, f, index) : r->GetUInt32(m, f));
      break;
    case FieldDescriptor::CPPTYPE_INT64:
      absl::StrAppend(out, Int64(rep ? r->GetRepeatedInt64(m, f, index) : r->GetInt64(m, f)));
      break;
    case FieldDescriptor::CPPTYPE_UINT64:
      absl::StrAppend(out, UInt64(rep ? r->GetRepeatedUInt64(m, f, index) : r->GetUInt64(m, f)));
      break;
    case FieldDescriptor::CPPTYPE_DOUBLE:
      absl::StrAppend(out, Double(rep ? r->GetRepeatedDouble(m, f, index) : r->GetDouble(m, f)));
      break;
    case FieldDescriptor::CPPTYPE_FLOAT:
      absl::StrAppend(out, Float(rep ? r->GetRepeatedFloat(m, f, index) : r->GetFloat(m, f)));
      break;
    case FieldDescriptor::CPPTYPE_BOOL:
      absl::StrAppend(out, (rep ? r->GetRepeatedBool(m, f, index) : r->GetBool(m, f)) ? "true" : "false");
      break;
    case FieldDescriptor::CPPTYPE_ENUM: {
      const int v = rep ? r->GetRepeatedEnumValue(m, f, index) : r->GetEnumValue(m, f);
      const auto* e = f->enum_type()->FindValueByNumber(v);
      // A number this build does not know (a newer coordinator) as a number.
      absl::StrAppend(out, e != nullptr ? JsonString(e->name()) : absl::StrCat(v));
      break;
    }
    case FieldDescriptor::CPPTYPE_STRING: {
      const std::string s = rep ? r->GetRepeatedString(m, f, index) : r->GetString(m, f);
      absl::StrAppend(out, f->type() == FieldDescriptor::TYPE_BYTES ? JsonString(absl::Base64Escape(s))
                                                                    : JsonString(s));
      break;
    }
    case FieldDescriptor::CPPTYPE_MESSAGE:
      AppendMessage(rep ? r->GetRepeatedMessage(m, f, index) : r->GetMessage(m, f), out);
      break;
  }
}

void AppendMessage(const Message& m, std::string* out) {
  const auto* d = m.GetDescriptor();
  if (d->full_name() == "google.protobuf.Timestamp") {
    const auto& t = static_cast<const google::protobuf::Timestamp&>(m);
    absl::StrAppend(out, JsonString(google::protobuf::util::TimeUtil::ToString(t)));
    return;
  }
  const Reflection* r = m.GetReflection();
  out->push_back('{');
  bool first = true;
  for (int i = 0; i < d->field_count(); ++i) {
    const FieldDescriptor* f = d->field(i);
    // Presence is the answer for these: printed only when set.
    if (!f->is_repeated() && f->has_presence() && !r->HasField(m, f)) continue;
    if (!first) out->push_back(',');
    first = false;
    absl::StrAppend(out, JsonString(f->name()), ":");
    if (f->is_map()) {
      // A map is repeated entries of {key, value}: a JSON object, keys as
      // strings, in key order (protobuf's own order changes run to run, and
      // a script diffing two outputs would see it).
      const auto* key = f->message_type()->map_key();
      const auto* value = f->message_type()->map_value();
      std::vector<std::pair<std::string, std::string>> entries;
      for (int k = 0; k < r->FieldSize(m, f); ++k) {
        const Message& entry = r->GetRepeatedMessage(m, f, k);
        std::string key_text, value_text;
        AppendValue(entry, key, -1, &key_text);
        if (key->cpp_type() != FieldDescriptor::CPPTYPE_STRING) key_text = JsonString(key_text);
        AppendValue(entry, value, -1, &value_text);
        entries.emplace_back(std::move(key_text), std::move(value_text));
      }
      std::sort(entries.begin(), entries.end());
      out->push_back('{');
      for (size_t k = 0; k < entries.size(); ++k) {
        absl::StrAppend(out, k > 0 ? "," : "", entries[k].first, ":", entries[k].second);
      }
      out->push_back('}');
    } else if (f->is_repeated()) {
      out->push_back('[');
      for (int k = 0; k < r->FieldSize(m, f); ++k) {
        if (k > 0) out->push_back(',');
        AppendValue(m, f, k, out);
      }
      out->push_back(']');
    } else {
      AppendValue(m, f, -1, out);
    }
  }
  out->push_back('}');
}

}  // namespace

std::string JsonString(const std::string& s) {
  std::string out = "\"";
  for (unsigned char c : s) {
    switch (c) {
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      case '\n':
        out += "\\n";
        break;
      case '\r':
        out += "\\r";
        break;
      case '\t':
        out += "\\t";
        break;
      default:
        if (c < 0x20 || c == 0x7f) {
          out += absl::StrFormat("\\u%04x", c);
        } else {
          out.push_back(static_cast<char>(c));  // UTF-8 passes through
        }
    }
  }
  out.push_back('"');
  return out;
}

std::string ToJson(const google::protobuf::Message& m) {
  std::string out;
  AppendMessage(m, &out);
  return out;
}

std::string ErrorJson(const absl::Status& s, int exit_code) {
  return absl::StrCat("{\"error\":{\"code\":", JsonString(absl::StatusCodeToString(s.code())),
                      ",\"message\":", JsonString(std::string(s.message())), ",\"exit_code\":", exit_code, "}}");
}

}  // namespace plateau
