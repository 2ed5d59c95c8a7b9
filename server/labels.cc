#include "server/labels.h"

#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"

namespace plateau {
namespace {

bool AlnumAscii(char c) { return absl::ascii_isalnum(static_cast<unsigned char>(c)); }

// A name part or a value: [A-Za-z0-9] at both ends, [-_.A-Za-z0-9] between.
bool IsName(absl::string_view s) {
  if (s.empty() || s.size() > 63 || !AlnumAscii(s.front()) || !AlnumAscii(s.back())) return false;
  for (char c : s) {
    if (!AlnumAscii(c) && c != '-' && c != '_' && c != '.') return false;
  }
  return true;
}

bool IsDnsSubdomain(absl::string_view s) {
  if (s.empty() || s.size() > 253) return false;
  auto lower_alnum = [](char c) { return (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9'); };
  if (!lower_alnum(s.front()) || !lower_alnum(s.back())) return false;
  for (char c : s) {
    if (!lower_alnum(c) && c != '-' && c != '.') return false;
  }
  return true;
}

// Quoted and cut, so that a huge or binary key cannot flood the message.
std::string Shown(absl::string_view s) {
  std::string out = absl::CHexEscape(s.substr(0, 80));
  return absl::StrCat("'", out, s.size() > 80 ? "...'" : "'");
}

// Why `key` is not a label key ("expected ..., got ..."); empty when it is.
std::string KeyProblem(absl::string_view key) {
  const size_t slash = key.find('/');
  absl::string_view name = key;
  if (slash != absl::string_view::npos) {
    const absl::string_view prefix = key.substr(0, slash);
    name = key.substr(slash + 1);
    if (!IsDnsSubdomain(prefix)) {
      return absl::StrCat("expected a DNS-subdomain prefix before '/' (at most 253 characters of [-.a-z0-9], "
                          "[a-z0-9] at both ends), got ",
                          Shown(prefix), " in ", Shown(key));
    }
  }
  if (!IsName(name)) {
    return absl::StrCat("expected a name of 1 to 63 characters, [A-Za-z0-9] at both ends and "
                        "[-_.A-Za-z0-9] between, optionally after a DNS-subdomain prefix and '/'; got ",
                        Shown(key), name.size() > 63 ? absl::StrCat(" (", name.size(), " characters)") : "");
  }
  return "";
}

std::string ValueProblem(absl::string_view value) {
  if (value.empty() || IsName(value)) return "";
  return absl::StrCat("expected an empty value or 1 to 63 characters, [A-Za-z0-9] at both ends and "
                      "[-_.A-Za-z0-9] between; got ",
                      Shown(value), value.size() > 63 ? absl::StrCat(" (", value.size(), " characters)") : "");
}

}  // namespace

absl::Status CheckLabels(const google::protobuf::Map<std::string, std::string>& labels, const char* field) {
  if (labels.size() > static_cast<size_t>(kMaxLabels)) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ": expected at most ", kMaxLabels, " labels, got ", labels.size()));
  }
  // In key order, so that the error names the same label every time.
  std::map<std::string, std::string> sorted(labels.begin(), labels.end());
  for (const auto& [key, value] : sorted) {
    // "labels.key: ..." and "labels.value: ...": the field path (as every
    // spec error starts), then the label.
    if (std::string why = KeyProblem(key); !why.empty()) {
      return absl::InvalidArgumentError(absl::StrCat(field, ".key: ", why));
    }
    if (std::string why = ValueProblem(value); !why.empty()) {
      return absl::InvalidArgumentError(absl::StrCat(field, ".value: of the key ", Shown(key), ": ", why));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<LabelSelector> LabelSelector::Parse(const std::string& text, const char* field) {
  LabelSelector out;
  if (text.size() > 4096) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ": expected at most 4096 characters, got ", text.size()));
  }
  if (absl::StripAsciiWhitespace(text).empty()) return out;
  for (absl::string_view part : absl::StrSplit(text, ',')) {
    part = absl::StripAsciiWhitespace(part);
    const absl::string_view whole = part;  // for the message; `part` is consumed
    auto bad = [&](const std::string& why) {
      return absl::InvalidArgumentError(absl::StrCat(field, ": requirement ", Shown(whole), ": ", why));
    };
    if (part.empty()) return bad("expected key=value, key!=value, key or !key (an empty requirement)");
    LabelRequirement r;
    size_t at;
    if (absl::ConsumePrefix(&part, "!")) {
      r.op = LabelRequirement::Op::kNotExists;
      r.key = std::string(absl::StripAsciiWhitespace(part));
    } else if ((at = part.find("!=")) != absl::string_view::npos) {
      r.op = LabelRequirement::Op::kNotEquals;
      r.key = std::string(absl::StripAsciiWhitespace(part.substr(0, at)));
      r.value = std::string(absl::StripAsciiWhitespace(part.substr(at + 2)));
    } else if ((at = part.find('=')) != absl::string_view::npos) {
      r.op = LabelRequirement::Op::kEquals;
      absl::string_view value = part.substr(at + 1);
      absl::ConsumePrefix(&value, "=");  // key==value
      r.key = std::string(absl::StripAsciiWhitespace(part.substr(0, at)));
      r.value = std::string(absl::StripAsciiWhitespace(value));
    } else {
      r.op = LabelRequirement::Op::kExists;
      r.key = std::string(part);
      if (r.key.find_first_of(" \t(") != std::string::npos) {
        return bad("set-based requirements (in, notin) are not supported; expected key=value, "
                   "key!=value, key or !key");
      }
    }
    if (std::string why = KeyProblem(r.key); !why.empty()) return bad(absl::StrCat("key: ", why));
    if (std::string why = ValueProblem(r.value); !why.empty()) return bad(absl::StrCat("value: ", why));
    out.requirements_.push_back(std::move(r));
  }
  return out;
}

bool LabelSelector::Matches(const google::protobuf::Map<std::string, std::string>& labels) const {
  for (const LabelRequirement& r : requirements_) {
    auto it = labels.find(r.key);
    const bool has = it != labels.end();
    switch (r.op) {
      case LabelRequirement::Op::kEquals:
        if (!has || it->second != r.value) return false;
        break;
      case LabelRequirement::Op::kNotEquals:
        if (has && it->second == r.value) return false;
        break;
      case LabelRequirement::Op::kExists:
        if (!has) return false;
        break;
      case LabelRequirement::Op::kNotExists:
        if (has) return false;
        break;
    }
  }
  return true;
}

}  // namespace plateau
