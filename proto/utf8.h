// Text bound for proto3 `string` fields, which must be valid UTF-8: protobuf
// refuses to parse a whole message with one string that is not. A stray
// byte in a rank's output (a Latin-1 path in an error, a progress bar cut
// mid-character) would otherwise cost the agent's whole telemetry batch,
// every step report in it included, or leave a stored log row that no
// later read can parse.
//
// Thread safety: free functions without shared state.
#ifndef PLATEAU_PROTO_UTF8_H_
#define PLATEAU_PROTO_UTF8_H_

#include <cstddef>
#include <string>

#include "absl/strings/string_view.h"
#include "google/protobuf/message.h"

namespace plateau {

// Whether `s` is well-formed UTF-8 (Unicode 15 table 3-7: no overlong
// forms, no surrogates, nothing past U+10FFFF), as protobuf checks it.
bool IsValidUtf8(absl::string_view s);

// `s` with every byte that is not part of a well-formed sequence replaced
// by U+FFFD, the replacement character; `s` itself when it is valid.
std::string ToValidUtf8(absl::string_view s);

// The longest prefix of `s` (valid UTF-8) of at most `max_bytes` that ends
// on a character boundary: a cut that does not split a character.
absl::string_view Utf8Prefix(absl::string_view s, size_t max_bytes);

// The byte offset of the first control character in `s` (UTF-8): C0 (tab
// and newline included), DEL, or C1 (the two bytes C2 80..C2 9F), which a
// terminal acts on (escape sequences can rewrite what an operator sees);
// s.size() when there is none.
size_t FirstControlCharacter(absl::string_view s);

// Makes every string field set in `m`, in its nested messages too, valid
// UTF-8 (ToValidUtf8). Returns how many strings it changed.
int MakeStringsValidUtf8(google::protobuf::Message& m);

}  // namespace plateau

#endif  // PLATEAU_PROTO_UTF8_H_
