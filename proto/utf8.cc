#include "proto/utf8.h"

#include <vector>

#include "google/protobuf/descriptor.h"

namespace plateau {
namespace {

// The length of the well-formed sequence at the start of `s`, 0 when it
// does not start with one (table 3-7: the second byte's range depends on the
// first; the others are 80..BF).
size_t SequenceLength(absl::string_view s) {
  const auto b = [&](size_t i) { return static_cast<unsigned char>(s[i]); };
  const unsigned char c = b(0);
  if (c < 0x80) return 1;
  size_t n;
  unsigned char lo = 0x80, hi = 0xBF;  // the second byte's range
  if (c >= 0xC2 && c <= 0xDF) {
    n = 2;
  } else if (c >= 0xE0 && c <= 0xEF) {
    n = 3;
    if (c == 0xE0) lo = 0xA0;  // no overlong form
    if (c == 0xED) hi = 0x9F;  // no surrogate
  } else if (c >= 0xF0 && c <= 0xF4) {
    n = 4;
    if (c == 0xF0) lo = 0x90;  // no overlong form
    if (c == 0xF4) hi = 0x8F;  // nothing past U+10FFFF
  } else {
    return 0;  // 80..C1 (a continuation, an overlong lead) or F5..FF
  }
  if (s.size() < n || b(1) < lo || b(1) > hi) return 0;
  for (size_t i = 2; i < n; ++i) {
    if (b(i) < 0x80 || b(i) > 0xBF) return 0;
  }
  return n;
}

}  // namespace

bool IsValidUtf8(absl::string_view s) {
  while (!s.empty()) {
    const size_t n = SequenceLength(s);
    if (n == 0) return false;
    s.remove_prefix(n);
  }
  return true;
}

std::string ToValidUtf8(absl::string_view s) {
  std::string out;
  out.reserve(s.size());
  while (!s.empty()) {
    const size_t n = SequenceLength(s);
    if (n == 0) {
      out += "\xEF\xBF\xBD";  // U+FFFD
      s.remove_prefix(1);
    } else {
      out.append(s.data(), n);
      s.remove_prefix(n);
    }
  }
  return out;
}

absl::string_view Utf8Prefix(absl::string_view s, size_t max_bytes) {
  if (s.size() <= max_bytes) return s;
  size_t end = max_bytes;
  // Back off the continuation bytes (10xxxxxx) of a character the cut
  // splits, then its lead byte.
  while (end > 0 && (static_cast<unsigned char>(s[end]) & 0xC0) == 0x80) --end;
  return s.substr(0, end);
}

size_t FirstControlCharacter(absl::string_view s) {
  for (size_t i = 0; i < s.size(); ++i) {
    const auto c = static_cast<unsigned char>(s[i]);
    // C2 80..C2 9F only: C2 before an ASCII byte is no character at all.
    const bool c1 = c == 0xC2 && i + 1 < s.size() && static_cast<unsigned char>(s[i + 1]) >= 0x80 &&
                    static_cast<unsigned char>(s[i + 1]) <= 0x9F;
    if (c < 0x20 || c == 0x7F || c1) return i;
  }
  return s.size();
}

int MakeStringsValidUtf8(google::protobuf::Message& m) {
  using google::protobuf::FieldDescriptor;
  const google::protobuf::Reflection* r = m.GetReflection();
  std::vector<const FieldDescriptor*> fields;
  r->ListFields(m, &fields);
  int changed = 0;
  for (const FieldDescriptor* f : fields) {
    if (f->type() == FieldDescriptor::TYPE_STRING) {
      if (f->is_repeated()) {
        for (int i = 0; i < r->FieldSize(m, f); ++i) {
          std::string scratch;
          const std::string& v = r->GetRepeatedStringReference(m, f, i, &scratch);
          if (IsValidUtf8(v)) continue;
          r->SetRepeatedString(&m, f, i, ToValidUtf8(v));
          ++changed;
        }
      } else {
        std::string scratch;
        const std::string& v = r->GetStringReference(m, f, &scratch);
        if (IsValidUtf8(v)) continue;
        r->SetString(&m, f, ToValidUtf8(v));
        ++changed;
      }
    } else if (f->cpp_type() == FieldDescriptor::CPPTYPE_MESSAGE) {
      if (f->is_repeated()) {
        for (int i = 0; i < r->FieldSize(m, f); ++i) {
          changed += MakeStringsValidUtf8(*r->MutableRepeatedMessage(&m, f, i));
        }
      } else {
        changed += MakeStringsValidUtf8(*r->MutableMessage(&m, f));
      }
    }
  }
  return changed;
}

}  // namespace plateau
