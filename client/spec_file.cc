#include "client/spec_file.h"

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <limits>
#include <map>
#include <string>
#include <system_error>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "google/protobuf/descriptor.h"
#include "google/protobuf/io/tokenizer.h"
#include "google/protobuf/io/zero_copy_stream_impl_lite.h"
#include "google/protobuf/stubs/common.h"
#include "google/protobuf/text_format.h"

namespace plateau {
namespace {

namespace pb = google::protobuf;

// Keeps the parser's first error (later ones are consequences of it).
class FirstError : public pb::io::ErrorCollector {
 public:
  void AddError(int line, pb::io::ColumnNumber column, const std::string& message) override {
    if (seen) return;
    seen = true;
    this->line = line;
    this->column = column;
    this->message = message;
  }
  void AddWarning(int, pb::io::ColumnNumber, const std::string&) override {}
  bool seen = false;
  int line = 0, column = 0;  // 0-based, as the tokenizer counts
  std::string message;
};

class Quiet : public pb::io::ErrorCollector {
 public:
  void AddError(int, pb::io::ColumnNumber, const std::string&) override {}
};

// A token of the file in its place in the message tree.
struct Place {
  int line = 0, column = 0;
  std::string text;
  std::vector<std::string> path;  // the field it names or gives a value to
};

// The field names and the values of `text` up to the token at (line,
// column), each with its dotted path, and `*context`: the path of the field
// whose name or value that token is (or of the message it lies in). A small
// reader of the text format's shape (name ':' value | name '{' ... '}' |
// name ':' '[' values ']'), tokenized as TextFormat does ('#' comments). It
// never fails; on input the parser refused it only has to be right up to
// the error.
void Scan(absl::string_view text, int line, int column, std::vector<Place>* names, std::vector<Place>* values,
          std::vector<std::string>* context) {
  pb::io::ArrayInputStream in(text.data(), static_cast<int>(text.size()));
  Quiet quiet;
  pb::io::Tokenizer tok(&in, &quiet);
  tok.set_allow_f_after_float(true);
  tok.set_comment_style(pb::io::Tokenizer::SH_COMMENT_STYLE);
  tok.set_require_space_after_number(false);
  tok.set_allow_multiline_strings(true);
  std::vector<std::string> stack;  // enclosing message fields
  std::string field;               // the last field name read in this message
  enum { kName, kAfterName, kValue } state = kName;
  bool in_list = false;
  auto here = [&]() {
    std::vector<std::string> p = stack;
    if (state != kName || in_list) p.push_back(field);
    return p;
  };
  while (tok.Next()) {
    const pb::io::Tokenizer::Token& t = tok.current();
    Place p{t.line, t.column, t.text, stack};
    const bool at_error = !(t.line < line || (t.line == line && t.column < column));
    if (at_error) *context = here();
    if (t.type == pb::io::Tokenizer::TYPE_IDENTIFIER && state == kName && !in_list) {
      field = t.text;
      p.path.push_back(field);
      names->push_back(p);
      if (at_error) *context = p.path;  // an unknown or repeated field's name
      state = kAfterName;
    } else if (t.text == ":") {
      state = kValue;
    } else if (t.text == "{" || t.text == "<") {
      stack.push_back(field);
      field.clear();
      state = kName;
    } else if (t.text == "}" || t.text == ">") {
      if (!stack.empty()) {
        field = stack.back();
        stack.pop_back();
      }
      state = kName;
    } else if (t.text == "[" && state == kValue) {
      in_list = true;
    } else if (t.text == "]") {
      in_list = false;
      state = kName;
    } else if (t.text == "-" && state == kValue) {
      // the sign of a number or of -inf: the value follows
    } else if (t.text == ";" || t.text == ",") {
      if (!in_list) state = kName;
    } else if (state == kValue || in_list) {
      p.path.push_back(field);
      values->push_back(p);
      if (!in_list) state = kName;
    }
    if (at_error) return;
  }
  *context = here();  // the error is at the end of the text
}

// "name \"F\"" -> F (the first quoted word after `after`), or "".
std::string Quoted(const std::string& message, const std::string& after) {
  const size_t at = message.find(after);
  if (at == std::string::npos) return "";
  const size_t open = message.find('"', at + after.size());
  if (open == std::string::npos) return "";
  const size_t close = message.find('"', open + 1);
  if (close == std::string::npos) return "";
  return message.substr(open + 1, close - open - 1);
}

// The field at `path` from JobSpec, and the message that holds it (for
// unknown names: the message that has no such field).
struct Resolved {
  const pb::Descriptor* parent = nullptr;
  const pb::FieldDescriptor* field = nullptr;
};
Resolved Resolve(const std::vector<std::string>& path) {
  Resolved r;
  r.parent = v1::JobSpec::descriptor();
  for (size_t i = 0; i < path.size(); ++i) {
    r.field = r.parent->FindFieldByName(path[i]);
    if (r.field == nullptr) return r;
    if (i + 1 < path.size()) {
      if (r.field->message_type() == nullptr) return {};
      r.parent = r.field->message_type();
    }
  }
  return r;
}

std::string TypeOf(const pb::FieldDescriptor* f) {
  std::string t = f->type() == pb::FieldDescriptor::TYPE_ENUM      ? "enum " + f->enum_type()->full_name()
                  : f->type() == pb::FieldDescriptor::TYPE_MESSAGE ? "message " + f->message_type()->full_name()
                                                                   : f->type_name();
  return f->is_repeated() ? "repeated " + t : t;
}

// "FIELD (TYPE): MESSAGE[; what is expected]" for the parser's error, and
// the position of the token it is about.
std::string Describe(absl::string_view text, const FirstError& e, int* line, int* column) {
  std::vector<Place> names, values;
  std::vector<std::string> context;
  Scan(text, e.line, e.column, &names, &values, &context);
  *line = e.line;
  *column = e.column;
  // Some errors are reported at the token after the one they are about,
  // which they quote: point at that one instead.
  const std::string unknown_field = Quoted(e.message, "has no field named");
  const std::string repeated_field = Quoted(e.message, "Non-repeated field");
  const std::string bad_enum = Quoted(e.message, "Unknown enumeration value of");
  const std::string& named = !unknown_field.empty() ? unknown_field : repeated_field;
  const Place* about = nullptr;
  for (const Place& p : !named.empty() ? names : values) {
    if (p.text == (!named.empty() ? named : bad_enum)) about = &p;
  }
  if (about != nullptr && (!named.empty() || !bad_enum.empty())) {
    context = about->path;
    *line = about->line;
    *column = about->column;
  }
  // "1e5x": the identifier glued to the number is not a field's name.
  if (absl::StartsWith(e.message, "Need space between number and identifier") && !values.empty()) {
    context = values.back().path;
  }
  std::vector<std::string> path;
  for (const std::string& s : context) {
    if (!s.empty()) path.push_back(s);
  }
  if (path.empty()) return e.message;
  std::string out = absl::StrJoin(path, ".");
  std::string hint;
  const Resolved r = Resolve(path);
  if (r.field != nullptr) {
    absl::StrAppend(&out, " (", TypeOf(r.field), ")");
    if (r.field->enum_type() != nullptr && !bad_enum.empty()) {
      std::vector<std::string> names_of;
      for (int i = 0; i < r.field->enum_type()->value_count(); ++i) {
        names_of.push_back(r.field->enum_type()->value(i)->name());
      }
      hint = absl::StrCat("; expected one of ", absl::StrJoin(names_of, ", "));
    }
  } else if (r.parent != nullptr && !unknown_field.empty()) {
    std::vector<std::string> fields;
    for (int i = 0; i < r.parent->field_count(); ++i) fields.push_back(r.parent->field(i)->name());
    hint = absl::StrCat("; the fields of ", r.parent->full_name(), " are ", absl::StrJoin(fields, ", "));
  }
  std::string message = e.message;
  if (absl::EndsWith(message, "got: ")) message += "the end of the file";
  if (!hint.empty() && absl::EndsWith(message, ".")) message.pop_back();
  return absl::StrCat(out, ": ", message, hint);
}

// The first string field of `m` that is not UTF-8, and where the file set
// it. The text format takes any bytes ("\\377"), but proto3 strings must be
// UTF-8 and the coordinator's wire parser would refuse the whole request
// without saying which field.
bool FindNonUtf8(const pb::Message& m, const pb::TextFormat::ParseInfoTree* tree, const std::string& prefix,
                 std::string* path, pb::TextFormat::ParseLocation* where) {
  std::vector<const pb::FieldDescriptor*> fields;
  m.GetReflection()->ListFields(m, &fields);
  for (const pb::FieldDescriptor* f : fields) {
    const int n = f->is_repeated() ? m.GetReflection()->FieldSize(m, f) : 1;
    for (int i = 0; i < n; ++i) {
      const int index = f->is_repeated() ? i : -1;
      const std::string name =
          absl::StrCat(prefix, prefix.empty() ? "" : ".", f->name(), f->is_repeated() ? absl::StrCat("[", i, "]") : "");
      if (f->type() == pb::FieldDescriptor::TYPE_STRING) {
        const std::string v = f->is_repeated() ? m.GetReflection()->GetRepeatedString(m, f, i)
                                               : m.GetReflection()->GetString(m, f);
        if (!pb::internal::IsStructurallyValidUTF8(v.data(), static_cast<int>(v.size()))) {
          *path = name;
          if (tree != nullptr) *where = tree->GetLocation(f, index);
          return true;
        }
      } else if (f->cpp_type() == pb::FieldDescriptor::CPPTYPE_MESSAGE) {
        const pb::Message& sub = f->is_repeated() ? m.GetReflection()->GetRepeatedMessage(m, f, i)
                                                  : m.GetReflection()->GetMessage(m, f);
        if (FindNonUtf8(sub, tree != nullptr ? tree->GetTreeForNested(f, index) : nullptr, name, path, where)) {
          return true;
        }
      }
    }
  }
  return false;
}

// A label key given twice. The text format takes a map entry's repeat as
// the new value, silently, where a repeated singular field ("steps: 1 steps:
// 2") is an error; a spec that says two things of one label is refused the
// same way. The parse tree has each entry's `key` location; the key's text
// is read from the tokens that follow it (the tokenizer's own columns).
bool FindRepeatedLabel(absl::string_view text, const v1::JobSpec& spec,
                       const pb::TextFormat::ParseInfoTree& tree, std::string* key,
                       pb::TextFormat::ParseLocation* first, pb::TextFormat::ParseLocation* again) {
  const pb::FieldDescriptor* labels = v1::JobSpec::descriptor()->FindFieldByName("labels");
  const pb::FieldDescriptor* key_field = labels->message_type()->FindFieldByName("key");
  // One nested tree per entry (a list, `labels [{...}, {...}]`, records one
  // location for the field but a tree for each entry).
  std::vector<pb::TextFormat::ParseLocation> where;  // its key's place, else its field's
  std::map<std::pair<int, int>, int> entry_at;       // a `key` token's place -> its entry
  while (const pb::TextFormat::ParseInfoTree* nested =
             tree.GetTreeForNested(labels, static_cast<int>(where.size()))) {
    const int i = static_cast<int>(where.size());
    pb::TextFormat::ParseLocation at = nested->GetLocation(key_field, -1);
    if (at.line >= 0) {
      entry_at[{at.line, at.column}] = i;
    } else {
      at = tree.GetLocation(labels, i);
      if (at.line < 0) at = tree.GetLocation(labels, 0);
    }
    where.push_back(at);
  }
  const int entries = static_cast<int>(where.size());
  if (entries <= spec.labels_size()) return false;
  std::vector<std::string> keys(entries);  // an entry without `key` has ""
  pb::io::ArrayInputStream in(text.data(), static_cast<int>(text.size()));
  Quiet quiet;
  pb::io::Tokenizer tok(&in, &quiet);
  tok.set_comment_style(pb::io::Tokenizer::SH_COMMENT_STYLE);
  tok.set_allow_multiline_strings(true);
  while (tok.Next()) {
    auto it = entry_at.find({tok.current().line, tok.current().column});
    if (it == entry_at.end()) continue;
    if (tok.Next() && tok.current().text == ":") tok.Next();
    // Adjacent strings are one value, as the parser takes them.
    while (tok.current().type == pb::io::Tokenizer::TYPE_STRING) {
      pb::io::Tokenizer::ParseStringAppend(tok.current().text, &keys[it->second]);
      if (!tok.Next()) break;
    }
  }
  std::map<std::string, int> seen;
  for (int i = 0; i < entries; ++i) {
    auto [it, inserted] = seen.emplace(keys[i], i);
    if (inserted) continue;
    *key = keys[i];
    *first = where[it->second];
    *again = where[i];
    return true;
  }
  return false;
}

}  // namespace

absl::StatusOr<v1::JobSpec> ParseSpecText(absl::string_view text, const std::string& name) {
  v1::JobSpec spec;
  pb::TextFormat::Parser parser;
  FirstError errors;
  parser.RecordErrorsTo(&errors);
  pb::TextFormat::ParseInfoTree tree;
  parser.WriteLocationsTo(&tree);
  if (text.size() > static_cast<size_t>(std::numeric_limits<int>::max()) ||
      !parser.ParseFromString(std::string(text), &spec)) {
    int line = errors.line, column = errors.column;
    const std::string what = errors.seen ? Describe(text, errors, &line, &column) : "cannot be parsed";
    return absl::InvalidArgumentError(
        absl::StrCat(name, ":", line + 1, ":", column + 1, ": ", what, " (a text-format plateau.v1.JobSpec)"));
  }
  std::string field;
  pb::TextFormat::ParseLocation where;
  if (FindNonUtf8(spec, &tree, "", &field, &where)) {
    return absl::InvalidArgumentError(absl::StrCat(name, ":", where.line + 1, ":", where.column + 1, ": ", field,
                                                   " (string): expected UTF-8 text, got bytes that are not UTF-8"));
  }
  std::string key;
  pb::TextFormat::ParseLocation first;
  if (FindRepeatedLabel(text, spec, tree, &key, &first, &where)) {
    return absl::InvalidArgumentError(
        absl::StrCat(name, ":", where.line + 1, ":", where.column + 1, ": labels: the key \"",
                     absl::CEscape(key), "\" is given again (first at ", first.line + 1, ":",
                     first.column + 1, "); a label has one value"));
  }
  return spec;
}

absl::StatusOr<v1::JobSpec> ReadSpecStream(std::istream& in, const std::string& name) {
  // Read at most one byte past the limit: a device or a huge file stops there.
  std::string text(kMaxSpecFileBytes + 1, '\0');
  in.read(text.data(), static_cast<std::streamsize>(text.size()));
  text.resize(static_cast<size_t>(in.gcount()));
  if (in.bad()) return absl::InvalidArgumentError(absl::StrCat(name, ": cannot read"));
  if (text.size() > kMaxSpecFileBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat(name, ": larger than ", kMaxSpecFileBytes,
                     " bytes; expected a text-format plateau.v1.JobSpec"));
  }
  return ParseSpecText(text, name);
}

absl::StatusOr<v1::JobSpec> ReadSpecFile(const std::string& path) {
  // `plateauctl submit -`: a spec another program writes.
  if (path == "-") return ReadSpecStream(std::cin, "<stdin>");
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec)) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": is a directory, expected a job spec file"));
  }
  errno = 0;
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    return absl::InvalidArgumentError(absl::StrCat(
        path, ": cannot open", errno != 0 ? absl::StrCat(" (", std::strerror(errno), ")") : ""));
  }
  return ReadSpecStream(in, path);
}

}  // namespace plateau
