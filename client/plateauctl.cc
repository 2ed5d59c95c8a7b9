// plateauctl: the command line of the Plateau service.
//
//   plateauctl [--coordinator=HOST:PORT] [--output=text|json] [--timeout=SECONDS]
//       [--token_file=PATH] [--tls_ca_file=PATH [--tls_client_cert_file=PATH --tls_client_key_file=PATH]]
//       COMMAND ...
//   plateauctl COMMAND --help
//
// The commands, their flags and the exit codes are one table below
// (Commands(), kExitCodes): --help and each command's --help are printed
// from it, and the flags a command accepts are checked against it.
//
// --output json is for scripts: one JSON object per line on stdout, every
// field printed with zero values included (client/json_output.h); an error
// is one JSON object {"error":{"code","message","exit_code"}} on stderr, so
// that stdout holds results only (a watch that breaks half-way has printed
// whole events, then nothing).
#include <sys/ioctl.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <filesystem>
#include <limits>
#include <map>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_replace.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "client/chart/png.h"
#include "client/client.h"
#include "client/connection.h"
#include "client/job_text.h"
#include "client/json_output.h"
#include "client/plan_table.h"
#include "client/spec_file.h"
#include "grpc/support/log.h"
#include "proto/does_not_fit.h"
#include "proto/utf8.h"
#include "timeline/memory_chart.h"
#include "timeline/png_chart.h"
#include "timeline/text_chart.h"

namespace plateau {
namespace {

// `s` with each control character a terminal would act on (C0 but tab,
// DEL, C1: proto/utf8.h FirstControlCharacter) written as \xNN (C1 as
// \u0080..\u009f): a job's log line or a failure naming a rank's output
// cannot move the cursor, retitle the window or write the clipboard of the
// operator who reads it. Bytes that are not UTF-8 (a stray 0x9B, which an
// 8-bit terminal reads as CSI) become U+FFFD first. `logs --raw` prints
// lines as they are.
std::string Visible(absl::string_view text) {
  const std::string valid = ToValidUtf8(text);
  absl::string_view s = valid;
  std::string out;
  while (!s.empty()) {
    const size_t i = FirstControlCharacter(s);
    out.append(s.data(), i);
    if (i == s.size()) break;
    const auto c = static_cast<unsigned char>(s[i]);
    if (c == '\t') {  // kept: it moves the cursor only as text does
      out += '\t';
      s.remove_prefix(i + 1);
    } else if (c == 0xC2) {  // C1: two bytes
      absl::StrAppend(&out, "\\u00", absl::Hex(static_cast<unsigned char>(s[i + 1]), absl::kZeroPad2));
      s.remove_prefix(i + 2);
    } else {
      absl::StrAppend(&out, "\\x", absl::Hex(c, absl::kZeroPad2));
      s.remove_prefix(i + 1);
    }
  }
  return out;
}

// Exit codes. 0-5 kept their meaning when 6 and 7 were split off 2
// (issue 16), and 8 after them; scripts may rely on every one of them.
constexpr int kExitOk = 0, kExitFailed = 1, kExitUsage = 2, kExitCancelled = 3, kExitUnreachable = 4,
              kExitDoesNotFit = 5, kExitNotFound = 6, kExitAlreadyFinished = 7, kExitServer = 8;

constexpr char kExitCodes[] = R"(exit codes
  0  ok; watch, submit --wait: the job SUCCEEDED
  1  the job FAILED (watch, submit --wait)
  2  usage error: an unknown command or flag, a missing argument, a bad flag
     value, a spec file that cannot be read; or a request the coordinator
     refused (INVALID_ARGUMENT naming the field, ALREADY_EXISTS for a
     request id used with another spec, UNAUTHENTICATED, ...)
  3  the job was CANCELLED (watch, submit --wait)
  4  the coordinator could not be reached (UNAVAILABLE; CANCELLED: its
     shutdown cancelled the call), as the Python client's 4
  5  the job's memory plan does not fit its device or host cap (plan, submit)
  6  no such job (NOT_FOUND)
  7  the job had already finished (cancel of a SUCCEEDED or FAILED job; a
     CANCELLED one is answered 0, as a cancel retried after a lost answer)
  8  the coordinator could not serve the request: a fault on its side
     (INTERNAL, DATA_LOSS, UNKNOWN, ABORTED, DEADLINE_EXCEEDED) or one of
     its limits (RESOURCE_EXHAUSTED: too many open watches from this host,
     still so after retrying with backoff for 60 s); the same command may
     succeed later
)";

constexpr char kGlobalFlags[] = R"(global flags (before or after the command)
  --coordinator=HOST:PORT  default $PLATEAU_COORDINATOR, else 127.0.0.1:7070
  --output=text|json       json: one object per line on stdout, every field
                           (zero values too; int64 as numbers below 2^53, as
                           strings above); errors as {"error":{"code":...,
                           "message":...,"exit_code":N}} on stderr
  --timeout=SECONDS        how long each call that is not a stream (every
                           command but watch, logs and submit --wait's
                           watch) waits for its answer: above 0, at most
                           3600, default 10; longer for a list --label scan
                           of a long history (DEADLINE_EXCEEDED) or to see a
                           large delete answered
  --token_file=PATH        the coordinator's bearer token, sent on every call
                           (default $PLATEAU_TOKEN_FILE)
  --tls_ca_file=PATH       PEM CA of the coordinator's certificate; turns TLS
                           on (default $PLATEAU_TLS_CA_FILE)
  --tls_client_cert_file=PATH
                           PEM certificate chain of this client, for a
                           coordinator that requires one (its
                           --tls_client_ca_file); with --tls_client_key_file
                           (default $PLATEAU_TLS_CLIENT_CERT_FILE)
  --tls_client_key_file=PATH
                           its private key (default
                           $PLATEAU_TLS_CLIENT_KEY_FILE)
Flags are given as --name=value or --name value (dashes or underscores alike),
before or after the command; after -- every argument is positional.
)";

struct FlagHelp {
  std::string name;   // without "--"
  std::string value;  // the value's placeholder; "" for a switch
  std::string help;
  bool repeatable = false;
};

struct CommandHelp {
  std::string name;
  std::string args;     // positional arguments, "" for none
  std::string summary;  // one line for the command list
  std::string details;  // the command's --help, before its flags
  std::vector<FlagHelp> flags;
};

const std::vector<CommandHelp>& Commands() {
  static const auto* commands = new std::vector<CommandHelp>{
      {"submit",
       "SPEC",
       "submit a job (a text-format plateau.v1.JobSpec); prints its plan",
       "Submits the job in SPEC (text-format plateau.v1.JobSpec; docs/SERVICE.md \"The job\n"
       "spec\") and prints its memory plan. Every submit carries a request id (a random one\n"
       "unless --request-id gives one): a submit whose answer was lost (UNAVAILABLE) is\n"
       "retried twice, 1 s apart, and the coordinator answers a retry with the job the first\n"
       "one created, never a second job. Exit 5 when the plan does not fit its device or\n"
       "host cap. SPEC - reads the spec from standard input.\n",
       {{"validate-only", "", "validate and plan; create nothing"},
        {"quiet", "", "without the plan: only the 'submitted' (or 'valid') line"},
        {"wait", "", "then watch the job to its end and exit with its outcome (0, 1, 3)"},
        {"label", "KEY=VALUE",
         "a label on the job (repeatable, one per key; added to the spec's\n"
         "labels, replacing the spec's value of that key)",
         true},
        {"request-id", "ID",
         "makes the submit idempotent across invocations: 1 to 128 of\n"
         "[A-Za-z0-9._:-]; the same ID with the same spec returns the same job,\n"
         "with another spec it is refused (exit 2, ALREADY_EXISTS naming the\n"
         "job); default: a new random one per invocation; --request-id= (empty)\n"
         "sends none"},
        {"priority", "N",
         "the job's place in the pending queue: -1000 to 1000, higher first\n"
         "(a running job is never preempted)"},
        {"max-duration", "SECONDS",
         "a wall-clock limit from the job's first start, across restarts\n"
         "(JobSpec.max_duration_s); then FAILED, MAX_DURATION_EXCEEDED"}}},
      {"plan",
       "SPEC",
       "the memory plan per live set; nothing is created",
       "Plans the job in SPEC without creating it: per-rank device and host bytes of every live\n"
       "set, N_max and the what-if table. Exit 5 when it does not fit its caps. SPEC - reads\n"
       "the spec from standard input.\n",
       {}},
      {"get",
       "JOB",
       "one job",
       "Prints one job: state, reason, failure, progress (once a step has been reported),\n"
       "placement (each worker and its ranks), layout, labels, times.\n",
       {}},
      {"list",
       "",
       "jobs, oldest first (or newest first); filters by state and labels",
       "Lists jobs one page at a time (--all: every page). Reasons are cut to the terminal\n"
       "width ($COLUMNS, else the terminal's) with \"...\"; a pipe or a file gets whole rows.\n",
       {{"state", "S[,S...]", "only jobs in these states (PENDING, RUNNING, ...)"},
        {"label", "SELECTOR",
         "only jobs whose labels match: comma-separated key=value,\n"
         "key!=value (also true without the key), key (present), !key\n"
         "(absent); repeatable (all must hold)",
         true},
        {"newest-first", "", "newest submitted first"},
        {"page_size", "N", "jobs per page (default 50, at most 1000)"},
        {"page_token", "T", "continue from a previous page (same filters and order)"},
        {"all", "", "every page"}}},
      {"watch",
       "JOB",
       "live progress to the end; exits with the job's outcome",
       "Streams the job's state changes and steps until its final state; exits 0, 1 or 3 with it.\n"
       "Each step line shows the elapsed time since the job started and an ETA (the steps left\n"
       "times the mean step time so far), and is cut to the terminal width ($COLUMNS, else the\n"
       "terminal's; a pipe or a file gets whole lines); state changes are wrapped, never cut.\n"
       "On a terminal it redraws one line at every step; off one\n"
       "(a pipe, a file) it prints a line for step 1, every (steps / 20)-th step, steps with a\n"
       "validation loss and the last step (--per-rank or --output json: every step). While the\n"
       "coordinator is away it says \"reconnecting...\" on stderr and resumes from the next\n"
       "event (under --output json: a {\"notice\":...} object). A watch the coordinator refuses\n"
       "for its limit of open watches per host (--max_watches_per_client) is retried with\n"
       "backoff for 60 s, saying so once, then exits 8.\n",
       {{"from", "INDEX", "the first event to show (resume with the last index + 1)"},
        {"per-rank", "",
         "under each step's line, each rank's: loss, time, device peak\n"
         "(every step, one line each); in JSON each step event carries them\n"
         "(job_step.per_rank)"}}},
      {"logs",
       "JOB",
       "log lines of every rank",
       "Prints the job's log lines: every rank's stdout and stderr, the agent's and the\n"
       "coordinator's.\n",
       {{"follow", "", "keep streaming until the job ends (also -f)"},
        {"from", "INDEX", "the first line to show"},
        {"rank", "N", "only rank N's lines (-1: the agent's and the coordinator's)"},
        {"tail", "N", "only the last N lines (with --follow: the last N, then new ones)"},
        {"timestamps", "",
         "each line's time first (when its rank, agent or the coordinator wrote it;\n"
         "the date too when not today): lines are in the order the coordinator\n"
         "stored them, which after an outage is not always the order they were written"},
        {"raw", "",
         "print the lines' control characters as they are (by default each is\n"
         "shown as \\xNN, so a line cannot drive the terminal)"}}},
      {"cancel",
       "JOB",
       "stop a job",
       "Cancels a job: its ranks are stopped, it ends CANCELLED. Exit 7 when it had\n"
       "already finished otherwise (SUCCEEDED or FAILED); 0 when it is CANCELLED.\n",
       {}},
      {"memory",
       "JOB",
       "the job's latest memory timeline as a chart",
       "Draws the job's latest memory timeline (one step of one rank) as a terminal chart per\n"
       "memory space, or a PNG; the page http://METRICS/jobs/JOB/memory draws it too.\n",
       {{"rank", "R", "the rank (default 0)"},
        {"width", "N", "chart columns, 10 to 1000 (default 64)"},
        {"png", "FILE", "write a PNG instead"}}},
      {"workers",
       "",
       "the registered workers",
       "Lists the registered workers: id, name, address, backend, slots free and total, device\n"
       "and host memory, last heartbeat, running jobs.\n",
       {}},
      {"delete",
       "JOB",
       "remove a finished job entirely",
       "Deletes a finished job with its events, logs, memory timelines and metric series. A\n"
       "job that has not finished is refused (exit 2, FAILED_PRECONDITION): cancel it first.\n"
       "The coordinator deletes a large job in parts and finishes even if plateauctl stops\n"
       "waiting (--timeout, 10 s) or the coordinator restarts meanwhile (its next start\n"
       "finishes it): a delete of it meanwhile is ABORTED (exit 8), then NOT_FOUND.\n",
       {}},
  };
  return *commands;
}

const CommandHelp* FindCommand(const std::string& name) {
  for (const CommandHelp& c : Commands()) {
    if (c.name == name) return &c;
  }
  return nullptr;
}

// A status that is the command line's fault (a --rank the job has no
// timeline of: NOT_FOUND where the memory page answers it) said as
// INVALID_ARGUMENT, the code of exit 2: NOT_FOUND is exit 6's, no such job.
absl::Status AsUsage(const absl::Status& s) {
  return s.ok() || s.code() == absl::StatusCode::kInvalidArgument ? s : absl::InvalidArgumentError(s.message());
}

const FlagHelp* FindFlag(const CommandHelp& c, const std::string& name) {
  const std::string canonical = name == "f" ? "follow" : name;
  for (const FlagHelp& f : c.flags) {
    if (f.name == canonical) return &f;
  }
  return nullptr;
}

bool IsGlobalFlag(const std::string& name) {
  return name == "coordinator" || name == "output" || name == "timeout" || name == "token_file" ||
         name == "tls_ca_file" || name == "tls_client_cert_file" || name == "tls_client_key_file";
}

// A flag's name as the command declares it: the commands' and the global
// flags' names mix dashes (--newest-first) and underscores (--page_size,
// --token_file, as the daemons' flags), so either spelling is taken for
// both; a name known in neither spelling stays as given (the unknown-flag
// error names it).
std::string CanonicalFlagName(const CommandHelp* command, const std::string& name) {
  auto known = [&](const std::string& n) {
    return IsGlobalFlag(n) || (command != nullptr && FindFlag(*command, n) != nullptr);
  };
  if (known(name)) return name;
  for (const std::string& other : {absl::StrReplaceAll(name, {{"-", "_"}}), absl::StrReplaceAll(name, {{"_", "-"}})}) {
    if (known(other)) return other;
  }
  return name;
}

// Where the command is in argv: the first argument that names a command
// ("help" too) and is not a global flag's value, or after "--" the next
// argument. A word before it is a flag's value or a positional argument
// (`--tail 5 logs`: 5), told apart once the command's flags are known.
// Without one, the first word that is no global flag's value (an unknown
// command, named as such); -1 when there is no word at all.
int CommandIndex(int argc, char** argv) {
  int first_word = -1;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--") return i + 1 < argc ? i + 1 : first_word;
    if (arg.rfind("--", 0) == 0) {
      // Its value (either spelling: CanonicalFlagName).
      if (arg.find('=') == std::string::npos && IsGlobalFlag(CanonicalFlagName(nullptr, arg.substr(2)))) ++i;
      continue;
    }
    if (arg == "-f" || arg == "-h") continue;
    if (arg == "help" || FindCommand(arg) != nullptr) return i;
    if (first_word < 0) first_word = i;
  }
  return first_word;
}

std::string Usage() {
  std::string out =
      "usage: plateauctl [--coordinator=HOST:PORT] [--output=text|json] [--timeout=SECONDS]\n"
      "                  [--token_file=PATH] [--tls_ca_file=PATH [--tls_client_cert_file=PATH "
      "--tls_client_key_file=PATH]]\n"
      "                  COMMAND [ARGS] [FLAGS]\n"
      "       plateauctl COMMAND --help     a command's arguments and flags\n\ncommands\n";
  for (const CommandHelp& c : Commands()) {
    absl::StrAppendFormat(&out, "  %-16s %s\n", absl::StrCat(c.name, c.args.empty() ? "" : " ", c.args), c.summary);
  }
  absl::StrAppend(&out, "\n", kGlobalFlags, "\n", kExitCodes);
  return out;
}

std::string CommandUsage(const CommandHelp& c) {
  std::string out = absl::StrCat("usage: plateauctl [GLOBAL FLAGS] ", c.name, c.args.empty() ? "" : " ", c.args,
                                 c.flags.empty() ? "" : " [FLAGS]", "\n\n", c.details);
  if (!c.flags.empty()) {
    out += "\nflags\n";
    for (const FlagHelp& f : c.flags) {
      const std::string spelled =
          absl::StrCat(f.name == "follow" ? "-f, " : "", "--", f.name, f.value.empty() ? "" : "=", f.value);
      std::vector<std::string> lines = absl::StrSplit(f.help, '\n');
      absl::StrAppendFormat(&out, "  %-24s %s\n", spelled, lines[0]);
      for (size_t i = 1; i < lines.size(); ++i) absl::StrAppendFormat(&out, "  %-24s %s\n", "", lines[i]);
    }
  }
  absl::StrAppend(&out,
                  "\nGlobal flags (--coordinator, --output, --timeout, --token_file, --tls_ca_file, "
                  "--tls_client_cert_file, --tls_client_key_file): plateauctl --help.\n\n",
                  kExitCodes);
  return out;
}

struct Options {
  std::string coordinator;
  ConnectionFiles files;  // --token_file, --tls_*_file
  bool json = false;
  absl::Duration timeout = absl::Seconds(10);  // --timeout: each unary call's deadline
  std::string command;
  std::vector<std::string> args;  // positional
  // Every value of each flag given, in order (a switch has one "" value).
  std::map<std::string, std::vector<std::string>> flags;
};

// --output json makes errors JSON too; set once by main before any error.
bool json_errors = false;
// --timeout, for the errors of a call that ran out of it; set once by Run.
absl::Duration unary_timeout = absl::Seconds(10);

// Prints `s` (text: "plateauctl: CODE: message"; json: ErrorJson) and
// returns `code`.
int Fail(const absl::Status& s, int code) {
  if (json_errors) {
    std::fprintf(stderr, "%s\n", ErrorJson(s, code).c_str());
  } else {
    std::fprintf(stderr, "plateauctl: %s%s\n",
                 s.code() == absl::StatusCode::kUnavailable
                     ? ""
                     : absl::StrCat(absl::StatusCodeToString(s.code()), ": ").c_str(),
                 Visible(s.message()).c_str());
  }
  return code;
}

// An error from the coordinator (or the channel) with its exit code: the
// command's fault (2) apart from the coordinator's (8), so that a script
// knows whether running it again can help. A unary call that ran out of
// --timeout (Client::Convert: "cannot reach ...: Deadline Exceeded") says
// so, then `after_timeout`.
int Report(const absl::Status& s, absl::string_view after_timeout = "") {
  switch (s.code()) {
    case absl::StatusCode::kUnavailable:
    case absl::StatusCode::kCancelled:  // a coordinator stopping cancels the calls in flight
      if (absl::StrContains(s.message(), ": Deadline Exceeded")) {
        return Fail(
            absl::Status(s.code(), absl::StrCat(s.message(), "; no answer within ",
                                                absl::ToDoubleSeconds(unary_timeout), " s (--timeout)", after_timeout)),
            kExitUnreachable);
      }
      return Fail(s, kExitUnreachable);
    case absl::StatusCode::kNotFound:
      return Fail(s, kExitNotFound);
    case absl::StatusCode::kInternal:
    case absl::StatusCode::kDataLoss:
    case absl::StatusCode::kUnknown:
    case absl::StatusCode::kAborted:
    case absl::StatusCode::kDeadlineExceeded:
      return Fail(s, kExitServer);
    case absl::StatusCode::kResourceExhausted:
      // A request over the coordinator's --max_request_bytes is the
      // command's to shrink (Client::Convert names the flag).
      return Fail(s, absl::StrContains(s.message(), "--max_request_bytes") ? kExitUsage : kExitServer);
    default:
      return Fail(s, kExitUsage);
  }
}

// A command line plateauctl refuses before calling anything: `message` is
// the whole line ("plateauctl list: --state: ...").
int UsageError(const std::string& message) {
  if (json_errors) {
    std::fprintf(stderr, "%s\n", ErrorJson(absl::InvalidArgumentError(message), kExitUsage).c_str());
  } else {
    std::fprintf(stderr, "%s\n", message.c_str());
  }
  return kExitUsage;
}

std::string Json(const google::protobuf::Message& m) { return ToJson(m); }

// A request id for a submit that names none: 128 random bits.
std::string NewRequestId() {
  std::random_device rd;
  return absl::StrFormat("plateauctl-%08x%08x%08x%08x", rd(), rd(), rd(), rd());
}

std::string MiB(int64_t b) { return absl::StrFormat("%.2f", b / 1048576.0); }

// The columns a line of `watch` or `list` may take: $COLUMNS when it is a
// positive number (what a shell exports, and what a test can set), else the
// terminal's width when stdout is one (100 if it does not say), else 0: no
// limit. A pipe or a file (a CI log, `watch > f`) has no terminal to fit
// and keeps every figure of a line; cutting it to 100 columns lost the
// peaks of every step line and the end of a failure's reason.
int TerminalWidth() {
  const char* env = std::getenv("COLUMNS");
  int columns = 0;
  if (env != nullptr && absl::SimpleAtoi(env, &columns) && columns > 0) return columns;
  if (!isatty(STDOUT_FILENO)) return 0;
  winsize ws{};
  if (ioctl(STDOUT_FILENO, TIOCGWINSZ, &ws) == 0 && ws.ws_col > 0) return ws.ws_col;
  return 100;  // a terminal that does not say its width
}

// The code point of `s` that starts at byte `i`: its length in bytes, and
// the columns a terminal gives it (2 in the East Asian wide and full-width
// blocks and for emoji, 0 for combining accents, else 1). A byte that
// starts no valid UTF-8 sequence counts as one byte in one column. Names,
// labels and reasons are UTF-8 in any script; the rest of a line is ASCII.
struct Glyph {
  size_t bytes;
  int columns;
};
Glyph GlyphAt(absl::string_view s, size_t i) {
  const unsigned char lead = static_cast<unsigned char>(s[i]);
  // Lead bytes C2-DF, E0-EF and F0-F4 start sequences of 2, 3 and 4 bytes;
  // C0, C1 and F5-FF never appear in UTF-8.
  const size_t n = lead < 0x80                   ? 1
                   : lead >= 0xC2 && lead <= 0xDF ? 2
                   : lead >= 0xE0 && lead <= 0xEF ? 3
                   : lead >= 0xF0 && lead <= 0xF4 ? 4
                                                  : 0;
  if (n == 0 || i + n > s.size()) return {1, 1};
  char32_t cp = n == 1 ? lead : lead & (0x7F >> n);
  for (size_t k = 1; k < n; ++k) {
    const unsigned char b = static_cast<unsigned char>(s[i + k]);
    if ((b & 0xC0) != 0x80) return {1, 1};
    cp = (cp << 6) | (b & 0x3F);
  }
  // Overlong forms, surrogates and code points past U+10FFFF are not UTF-8.
  static constexpr char32_t kLeast[] = {0, 0, 0x80, 0x800, 0x10000};
  if (cp < kLeast[n] || (cp >= 0xD800 && cp <= 0xDFFF) || cp > 0x10FFFF) return {1, 1};
  if (cp >= 0x300 && cp <= 0x36F) return {n, 0};
  const bool wide = (cp >= 0x1100 && cp <= 0x115F) || (cp >= 0x2E80 && cp <= 0xA4CF && cp != 0x303F) ||
                    (cp >= 0xAC00 && cp <= 0xD7A3) || (cp >= 0xF900 && cp <= 0xFAFF) ||
                    (cp >= 0xFE30 && cp <= 0xFE4F) || (cp >= 0xFF00 && cp <= 0xFF60) ||
                    (cp >= 0xFFE0 && cp <= 0xFFE6) || (cp >= 0x1F300 && cp <= 0x1F64F) ||
                    (cp >= 0x1F900 && cp <= 0x1F9FF) || (cp >= 0x20000 && cp <= 0x3FFFD);
  return {n, wide ? 2 : 1};
}

int Columns(absl::string_view s) {
  int columns = 0;
  for (size_t i = 0; i < s.size();) {
    const Glyph g = GlyphAt(s, i);
    columns += g.columns;
    i += g.bytes;
  }
  return columns;
}

// `text` cut to at most `width` columns, never inside a code point; with
// `mark`, "..." ends a cut text (when width allows it).
std::string CutToColumns(const std::string& text, int width, bool mark) {
  if (Columns(text) <= width) return text;
  const bool dots = mark && width > 3;
  const int room = dots ? width - 3 : std::max(0, width);
  size_t end = 0;
  for (int used = 0; end < text.size();) {
    const Glyph g = GlyphAt(text, end);
    if (used + g.columns > room) break;
    used += g.columns;
    end += g.bytes;
  }
  return text.substr(0, end) + (dots ? "..." : "");
}

// A table cell: `text` in exactly `width` columns, cut with "..." and
// padded with spaces (printf's %-16s counts bytes, not columns).
std::string Cell(const std::string& text, int width) {
  std::string cell = CutToColumns(text, width, /*mark=*/true);
  cell.append(std::max(0, width - Columns(cell)), ' ');
  return cell;
}

// `line` cut to `width` columns, "..." marking the cut; whole when width is
// 0 (no terminal: TerminalWidth).
std::string FitLine(const std::string& line, int width) {
  return width <= 0 ? line : CutToColumns(line, width, /*mark=*/true);
}

// `text` word-wrapped to `width` columns, for lines that must not lose
// their end (a summary): the continuation lines indented 4 more than the
// first; a word longer than a line is cut (FitLine).
std::string WrapLine(const std::string& text, int width) {
  if (width <= 0 || Columns(text) <= width) return text + "\n";  // its spacing kept (tables)
  const size_t indent = text.find_first_not_of(' ');
  if (indent == std::string::npos) return FitLine(text, width) + "\n";
  const std::string cont(indent + 4, ' ');
  std::string out, line = text.substr(0, indent);
  bool empty = true;  // no word on `line` yet
  for (absl::string_view word : absl::StrSplit(absl::string_view(text).substr(indent), ' ', absl::SkipEmpty())) {
    if (!empty && Columns(line) + 1 + Columns(word) > width) {
      absl::StrAppend(&out, FitLine(line, width), "\n");
      line = cont;
      empty = true;
    }
    absl::StrAppend(&line, empty ? "" : " ", word);
    empty = false;
  }
  absl::StrAppend(&out, FitLine(line, width), "\n");
  return out;
}

// A duration for a progress line: "42s", "3m07s", "2h05m".
std::string Clock(absl::Duration d) {
  const int64_t s = std::max<int64_t>(0, absl::ToInt64Seconds(d));
  if (s < 60) return absl::StrCat(s, "s");
  if (s < 3600) return absl::StrFormat("%dm%02ds", s / 60, s % 60);
  return absl::StrFormat("%dh%02dm", s / 3600, (s / 60) % 60);
}

// The file's spec; a parse error names the file, line, column and field
// (client/spec_file.h).
absl::StatusOr<v1::JobSpec> ReadSpec(const std::string& path) {
  auto parsed = ReadSpecFile(path);
  if (!parsed.ok()) return parsed.status();
  v1::JobSpec spec = *std::move(parsed);
  // Paths are read on the worker's node: make relative ones absolute here.
  // Against a current directory that was removed this threw (the CLI
  // aborted): an error naming the field.
  auto absolute = [](const std::string& field, std::string* p) -> absl::Status {
    if (p->empty() || (*p)[0] == '/') return absl::OkStatus();
    std::error_code ec;
    const std::filesystem::path made = std::filesystem::absolute(*p, ec);
    if (ec) {
      return absl::InvalidArgumentError(absl::StrCat(field, ": cannot make '", *p,
                                                     "' absolute (the current directory: ", ec.message(),
                                                     "); give an absolute path"));
    }
    *p = made.lexically_normal().string();
    return absl::OkStatus();
  };
  if (spec.data().has_text()) {
    if (absl::Status s = absolute("data.text.path", spec.mutable_data()->mutable_text()->mutable_path()); !s.ok())
      return s;
  }
  if (spec.data().has_shards()) {
    auto* paths = spec.mutable_data()->mutable_shards()->mutable_paths();
    for (int i = 0; i < paths->size(); ++i) {
      if (absl::Status s = absolute(absl::StrCat("data.shards.paths[", i, "]"), paths->Mutable(i)); !s.ok()) return s;
    }
  }
  if (!spec.checkpoint().directory().empty()) {
    if (absl::Status s = absolute("checkpoint.directory", spec.mutable_checkpoint()->mutable_directory()); !s.ok())
      return s;
  }
  return spec;
}

// "fits", or "DOES NOT FIT (short by X MiB)", for `total` bytes against
// `cap` (0: uncapped, checked when scheduled).
std::string Fit(int64_t total, int64_t cap) {
  if (cap == 0 || total <= cap) return "fits";
  // The bytes too: a few KiB short reads "0.00 MiB" in MiB alone.
  return absl::StrCat("DOES NOT FIT (short by ", total - cap, " bytes, ", MiB(total - cap), " MiB)");
}

void PrintPlan(const v1::MemoryPlan& p) {
  std::printf("memory plan per rank (device bytes per live set):\n");
  for (const v1::LiveSetBytes& ls : p.live_sets()) {
    std::printf("  %-12s %12lld  (%s MiB)\n", ls.live_set().c_str(), static_cast<long long>(ls.bytes()),
                MiB(ls.bytes()).c_str());
  }
  std::printf("  %-12s %12lld  (%s MiB) of %s: %s\n", "total", static_cast<long long>(p.total_bytes()),
              MiB(p.total_bytes()).c_str(),
              p.device_memory_bytes() ? absl::StrCat("a ", MiB(p.device_memory_bytes()), " MiB device").c_str()
                                      : "the whole device (no cap)",
              Fit(p.total_bytes(), p.device_memory_bytes()).c_str());
  // Host lines only when there is something to say: a host term, or a cap.
  const int64_t host_cap = p.host_memory_bytes();
  const std::string cap =
      host_cap > 0 ? absl::StrCat("a host cap of ", host_cap, " bytes (", MiB(host_cap), " MiB)") : "no host cap";
  if (p.host_total_bytes() > 0) {
    std::printf("memory plan per rank (host bytes per live set; the others hold none):\n");
    for (const v1::LiveSetBytes& ls : p.host_live_sets()) {
      if (ls.bytes() == 0) continue;
      std::printf("  %-12s %12lld  (%s MiB)\n", ls.live_set().c_str(), static_cast<long long>(ls.bytes()),
                  MiB(ls.bytes()).c_str());
    }
    std::printf("  %-12s %12lld  (%s MiB) of %s: %s\n", "total", static_cast<long long>(p.host_total_bytes()),
                MiB(p.host_total_bytes()).c_str(), cap.c_str(), Fit(p.host_total_bytes(), host_cap).c_str());
  } else if (host_cap > 0) {
    std::printf("host memory per rank: none planned, of %s: fits\n", cap.c_str());
  }
  std::printf("  %lld tokens per rank, %lld parameters (%lld active), %.3g model FLOPs per step\n",
              static_cast<long long>(p.tokens_per_rank()), static_cast<long long>(p.parameters()),
              static_cast<long long>(p.active_parameters()), p.model_flops_per_step());
  for (const std::string& n : p.notes()) std::printf("  note: %s\n", n.c_str());
  std::printf("%s", FormatAutoSettings(p).c_str());
  std::printf("%s", FormatWhatIf(p).c_str());
}

// The time of day for a time of today; with the date otherwise (a week-old
// job's "created 14:02:11" read as today's).
std::string Time(const google::protobuf::Timestamp& t) {
  if (t.seconds() == 0) return "-";
  const absl::TimeZone zone = absl::LocalTimeZone();
  const absl::Time at = absl::FromUnixSeconds(t.seconds());
  const bool today = absl::FormatTime("%Y-%m-%d", at, zone) == absl::FormatTime("%Y-%m-%d", absl::Now(), zone);
  return absl::FormatTime(today ? "%H:%M:%S" : "%Y-%m-%d %H:%M:%S", at, zone);
}

// With the date: a retention pass acts days after the job ended.
std::string DateTime(const google::protobuf::Timestamp& t) {
  if (t.seconds() == 0) return "-";
  return absl::FormatTime("%Y-%m-%d %H:%M:%S", absl::FromUnixSeconds(t.seconds()), absl::LocalTimeZone());
}

void PrintJob(const v1::Job& j) {
  std::printf("%s  %s%s\n", j.id().c_str(), v1::JobState_Name(j.state()).c_str(),
              j.spec().name().empty() ? "" : absl::StrCat("  (", j.spec().name(), ")").c_str());
  if (!j.state_reason().empty()) std::printf("  reason:   %s\n", Visible(j.state_reason()).c_str());
  if (j.unschedulable()) {
    std::printf("  pending:  unschedulable since %s\n", Time(j.unschedulable_since()).c_str());
  }
  std::printf("%s", FailureLine(j).c_str());
  const v1::Progress& p = j.progress();
  // Before the first step is reported the progress is all zeros: a "loss
  // 0.0000" would read as a measured loss, so say there is none yet.
  if (p.step() > 0) {
    std::printf(
        "  progress: step %lld/%lld, loss %.4f (first %.4f), lr %.4g, %.0f tokens/s, %.4f TFLOP/s (job: all ranks)\n",
        static_cast<long long>(p.step()), static_cast<long long>(p.total_steps()), p.loss(), p.first_loss(), j.lr(),
        p.tokens_per_second(), p.model_flops_per_second() / 1e12);
    if (j.has_validation_loss()) {
      std::printf("  validation: loss %.4f after step %lld (held-out sequences, every %lld steps)\n",
                  j.validation_loss(), static_cast<long long>(j.validation_step()),
                  static_cast<long long>(j.spec().validation_every()));
    }
  } else {
    std::printf("  progress: no step reported yet (of %lld)\n", static_cast<long long>(j.spec().steps()));
  }
  if (j.placement().empty()) {
    // Cleared when an attempt ends: only a scheduled or running job has one.
    std::printf("  placement: none (not running)\n");
  } else {
    std::vector<std::string> parts;
    for (const v1::Placement& pl : j.placement()) {
      parts.push_back(absl::StrCat(pl.worker_id(), " ranks ", absl::StrJoin(pl.ranks(), ",")));
    }
    std::printf("  placement: %s\n", absl::StrJoin(parts, "; ").c_str());
  }
  std::printf("  layout:   %lld ranks on %lld node(s), backend %s; attempt %d\n",
              static_cast<long long>(j.spec().layout().ranks()),
              static_cast<long long>(j.spec().layout().nodes() ? j.spec().layout().nodes() : 1),
              j.spec().backend() == v1::BACKEND_CUDA ? "cuda" : "cpu", j.attempt());
  std::printf("  times:    created %s, started %s, ended %s\n", Time(j.create_time()).c_str(),
              Time(j.start_time()).c_str(), Time(j.end_time()).c_str());
  if (!j.submitted_by().empty() || !j.cancelled_by().empty()) {
    std::printf("  by:       submitted by %s%s\n",
                j.submitted_by().empty() ? "(not recorded)" : j.submitted_by().c_str(),
                j.cancelled_by().empty() ? "" : absl::StrCat(", cancel requested by ", j.cancelled_by()).c_str());
  }
  if (j.has_events_deleted_time()) {
    std::printf("  events:   %lld deleted at %s by the retention pass (watch and logs send none)\n",
                static_cast<long long>(j.event_count()), DateTime(j.events_deleted_time()).c_str());
  }
  if (!j.spec().labels().empty()) {
    std::map<std::string, std::string> sorted(j.spec().labels().begin(), j.spec().labels().end());
    std::printf("  labels:   %s\n", absl::StrJoin(sorted, ", ", absl::PairFormatter("=")).c_str());
  }
  if (j.spec().priority() != 0 || j.spec().max_duration_s() > 0) {
    std::printf("  queue:    priority %d%s\n", j.spec().priority(),
                j.spec().max_duration_s() > 0
                    ? absl::StrCat(", max_duration_s ", j.spec().max_duration_s(), " (from its first start)").c_str()
                    : "");
  }
  std::printf("%s", FormatAutoSettings(j.plan()).c_str());
}

int ExitFor(v1::JobState s) {
  switch (s) {
    case v1::SUCCEEDED:
      return kExitOk;
    case v1::CANCELLED:
      return kExitCancelled;
    default:
      return kExitFailed;
  }
}

// The live progress view of `watch` and `submit --wait`.
// A job past the coordinator's --retention has its events and logs
// removed: `watch` and `logs` then receive none, which would read as a job
// that said nothing. Said on stderr (an object under --output json).
void SayRemoved(const v1::Job& j, bool json, const char* what) {
  if (!j.has_events_deleted_time()) return;
  const std::string message = absl::StrCat(j.id(), "'s ", what, " were removed at ", DateTime(j.events_deleted_time()),
                                           " by the coordinator's retention pass (--retention): nothing to show");
  if (json) {
    std::fprintf(stderr, "{\"notice\":{\"kind\":\"removed\",\"message\":%s}}\n", JsonString(message).c_str());
  } else {
    std::fprintf(stderr, "plateauctl: %s\n", message.c_str());
  }
  std::fflush(stderr);
}

int Watch(Client& client, const Options& o, const std::string& id, int64_t from) {
  auto job = client.GetJob(id);
  if (!job.ok()) return Report(job.status());
  // Swept: the coordinator refuses the stream (FAILED_PRECONDITION); the
  // job's final state is all there is.
  if (job->has_events_deleted_time()) {
    SayRemoved(*job, o.json, "events");
    return ExitFor(job->state());
  }
  const v1::MemoryPlan plan = job->plan();
  std::map<std::string, int64_t> planned;
  for (const auto& ls : plan.live_sets()) planned[ls.live_set()] = ls.bytes();
  const bool per_rank = o.flags.count("per-rank") > 0;
  // Per-rank lines go under their step's line: nothing is redrawn in place.
  const bool tty = !o.json && !per_rank && isatty(STDOUT_FILENO);
  const int width = TerminalWidth();
  const int64_t total = job->spec().steps();
  // Elapsed time counts from the job's start; a job not yet started when the
  // watch began starts at its RUNNING event.
  absl::Time started = job->start_time().seconds() > 0
                           ? absl::FromUnixSeconds(job->start_time().seconds()) +
                                 absl::Nanoseconds(job->start_time().nanos())
                           : absl::InfinitePast();
  const int64_t every = std::max<int64_t>(1, total / 20);
  std::map<std::string, int64_t> peak, host_peak;  // largest over ranks and steps
  int64_t peak_total = 0, host_peak_total = 0;
  double first_loss = -1, last_loss = 0, tokens = 0, seconds = 0, flops = 0, last_validation = -1;
  int64_t last_step = 0, first_step = 0, steps_seen = 0;
  v1::JobState final_state = v1::JOB_STATE_UNSPECIFIED;
  v1::StateChange final_change;
  bool line_open = false;
  auto peaks_line = [&]() {
    std::vector<std::string> parts;
    for (const auto& ls : plan.live_sets()) {
      if (ls.bytes() == 0 && peak[ls.live_set()] == 0) continue;
      parts.push_back(absl::StrCat(ls.live_set(), " ", MiB(peak[ls.live_set()]), "/", MiB(ls.bytes())));
    }
    return absl::StrJoin(parts, "  ");
  };
  // Host lines only once the plan or a peak has a host term.
  auto show_host = [&] { return plan.host_total_bytes() > 0 || host_peak_total > 0; };
  auto host_peaks_line = [&]() {
    std::vector<std::string> parts;
    for (const auto& ls : plan.host_live_sets()) {
      if (ls.bytes() == 0 && host_peak[ls.live_set()] == 0) continue;
      parts.push_back(absl::StrCat(ls.live_set(), " ", MiB(host_peak[ls.live_set()]), "/", MiB(ls.bytes())));
    }
    return absl::StrJoin(parts, "  ");
  };
  absl::Status s = client.WatchJob(id, from, [&](const v1::JobEvent& e) {
    if (o.json) {
      std::printf("%s\n", Json(e).c_str());
      std::fflush(stdout);
    }
    if (e.has_state_change()) {
      const v1::StateChange& c = e.state_change();
      if (c.state() == v1::SUCCEEDED || c.state() == v1::FAILED || c.state() == v1::CANCELLED) {
        final_state = c.state();
        final_change = c;
      }
      if (c.state() == v1::RUNNING && started == absl::InfinitePast()) {
        started = absl::FromUnixSeconds(e.time().seconds()) + absl::Nanoseconds(e.time().nanos());
      }
      if (!o.json) {
        if (line_open) std::printf("\n");
        line_open = false;
        // Wrapped, never cut: a state's reason (why a job failed or is
        // restarting) is what its reader came for.
        std::printf("%s", WrapLine(absl::StrFormat("[%s] %s %s: %s", Time(e.time()), id, v1::JobState_Name(c.state()),
                                                   Visible(c.reason())),
                                   width)
                              .c_str());
        std::fflush(stdout);
      }
      return true;
    }
    // One event per step of the whole job (peaks already the maximum over
    // ranks); an older coordinator's database holds one per rank instead,
    // whose rank 0 stands for the step.
    v1::JobStepSummary t;
    if (e.has_job_step()) {
      t = e.job_step();
    } else if (e.has_step()) {
      const v1::StepTelemetry& r = e.step();
      t.set_step(r.step());
      t.set_loss(r.loss());
      t.set_lr(r.lr());
      t.set_tokens(r.tokens());
      t.set_model_flops(r.model_flops());
      t.set_seconds(r.seconds());
      *t.mutable_peak() = r.peak();
      t.set_peak_total_bytes(r.peak_total_bytes());
      *t.mutable_host_peak() = r.host_peak();
      t.set_host_peak_total_bytes(r.host_peak_total_bytes());
      if (r.rank() != 0) t.set_step(-1);  // peaks only
    } else {
      return true;
    }
    for (const auto& ls : t.peak()) peak[ls.live_set()] = std::max(peak[ls.live_set()], ls.bytes());
    peak_total = std::max(peak_total, t.peak_total_bytes());
    for (const auto& ls : t.host_peak()) host_peak[ls.live_set()] = std::max(host_peak[ls.live_set()], ls.bytes());
    host_peak_total = std::max(host_peak_total, t.host_peak_total_bytes());
    if (t.step() < 0) return true;
    if (first_loss < 0) {
      first_loss = t.loss();
      first_step = t.step();
    }
    ++steps_seen;
    last_loss = t.loss();
    last_step = t.step();
    tokens += t.tokens();
    seconds += t.seconds();
    flops += t.model_flops();
    if (o.json) return true;
    if (t.has_validation_loss()) last_validation = t.validation_loss();
    // A step with a validation loss is always shown: it is rare and telling.
    const bool show = tty || per_rank || t.has_validation_loss() || t.step() % every == 0 || t.step() == 1 ||
                      t.step() == total;
    if (!show) return true;
    // Elapsed: from the start to when the step ended (StepEnded: the
    // ranks' time, not the storing; a replayed finished job shows the times
    // it had, not the time since). ETA: the steps left at the mean step
    // time of the steps this watch has seen.
    const absl::Time at = StepEnded(e);
    const std::string elapsed =
        started == absl::InfinitePast() || e.time().seconds() == 0 ? "-" : Clock(at - started);
    const int64_t left = std::max<int64_t>(0, total - t.step());
    const std::string eta = steps_seen > 0 && seconds > 0 ? Clock(absl::Seconds(seconds / steps_seen * left)) : "-";
    // Elapsed and ETA come before the long peaks, so a cut keeps them.
    const std::string line =
        FitLine(absl::StrFormat("step %5d/%d  loss %.4f  elapsed %s  eta %s  lr %.3g%s  %6.0f tokens/s  %.4f TFLOP/s "
                                "(job)  peak/plan MiB: %s%s",
                                t.step(), total, t.loss(), elapsed, eta, t.lr(),
                                t.has_validation_loss() ? absl::StrFormat("  val %.4f", t.validation_loss()) : "",
                                t.tokens() / t.seconds(), t.model_flops() / t.seconds() / 1e12, peaks_line(),
                                show_host() ? absl::StrCat("  host: ", host_peaks_line()) : ""),
                // A tty line is redrawn in place: one column short, so that the
                // cursor never wraps to a new line.
                tty ? std::max(1, width - 1) : width);
    if (tty) {
      std::printf("\r\033[K%s", line.c_str());
      line_open = true;
    } else {
      std::printf("%s\n", line.c_str());
    }
    for (const v1::StepTelemetry& r : t.per_rank()) {
      std::printf("%s\n", FitLine(absl::StrFormat("  rank %3d  loss %.4f  |g| %.3f  lr %.3g  %.3f s  device peak %s MiB"
                                                   "%s",
                                                   r.rank(), r.loss(), r.grad_norm(), r.lr(), r.seconds(),
                                                   MiB(r.peak_total_bytes()),
                                                   r.host_peak_total_bytes() > 0
                                                       ? absl::StrCat("  host peak ", MiB(r.host_peak_total_bytes()),
                                                                      " MiB")
                                                       : ""),
                                   width)
                               .c_str());
    }
    std::fflush(stdout);
    return true;
  }, per_rank);
  if (line_open) std::printf("\n");
  if (!s.ok()) return Report(s);
  // The job as it ended: its state when no final event was seen, and its
  // first loss (a watch resumed with --from has not seen step 1).
  auto now = client.GetJob(id);
  if (!now.ok()) return Report(now.status());
  if (final_state == v1::JOB_STATE_UNSPECIFIED) final_state = now->state();
  if (!o.json) {
    // Every summary line within the width, wrapped (not cut): it is the
    // record of the run.
    std::string summary;
    auto say = [&](const auto&... args) { absl::StrAppendFormat(&summary, args...); };
    say("summary: %s %s", id.c_str(), v1::JobState_Name(final_state).c_str());
    if (final_change.has_failure()) {
      const v1::Failure& f = final_change.failure();
      say(" (%s%s)", v1::Failure::Kind_Name(f.kind()).c_str(),
          f.live_set().empty() ? "" : absl::StrCat(", live set ", f.live_set()).c_str());
    }
    say("\n");
    if (first_loss >= 0 && seconds > 0) {
      if (first_step <= 1) {
        say("  loss %.17g -> %.17g over steps 1-%lld; %.0f tokens/s, %.4f TFLOP/s (model FLOPs, the job's: all "
            "ranks)\n",
            first_loss, last_loss, static_cast<long long>(last_step), tokens / seconds, flops / seconds / 1e12);
      } else {
        // Resumed: the loss starts at the job's first step (from the job, as
        // this watch never saw it); the rates are of the steps it covers.
        const bool known = now->progress().step() > 0;
        say("  loss %s -> %.17g (step 1 from the job)\n",
        known ? absl::StrFormat("%.17g", now->progress().first_loss()) : std::string("unknown"), last_loss);
        say("  this watch covers steps %lld-%lld of %lld: %.0f tokens/s, %.4f TFLOP/s (model FLOPs, the job's: all "
            "ranks)\n",
            static_cast<long long>(first_step), static_cast<long long>(last_step), static_cast<long long>(total),
            tokens / seconds, flops / seconds / 1e12);
      }
      if (last_validation >= 0) say("  validation loss %.17g (the latest this watch saw)\n", last_validation);
      say("  device peak per live set (largest over ranks) against the plan, MiB:\n");
      for (const auto& ls : plan.live_sets()) {
        const int64_t pk = peak[ls.live_set()];
        say("    %-12s %9s / %9s%s\n", ls.live_set().c_str(), MiB(pk).c_str(), MiB(ls.bytes()).c_str(),
            pk <= ls.bytes() ? ""
            : ls.live_set() == "dispatch" ? "  above the balanced estimate (standard_ep has no bound)"
                                          : "  OVER THE PLAN");
      }
      say("    %-12s %9s / %9s of %s\n", "total", MiB(peak_total).c_str(), MiB(plan.total_bytes()).c_str(),
          plan.device_memory_bytes() ? absl::StrCat("a ", MiB(plan.device_memory_bytes()), " MiB device").c_str()
                                     : "the whole device (no cap)");
      if (show_host()) {
        say("  host peak per live set (largest over ranks) against the plan, MiB:\n");
        for (const auto& ls : plan.host_live_sets()) {
          const int64_t pk = host_peak[ls.live_set()];
          if (pk == 0 && ls.bytes() == 0) continue;
          say("    %-12s %9s / %9s%s\n", ls.live_set().c_str(), MiB(pk).c_str(), MiB(ls.bytes()).c_str(),
              pk <= ls.bytes() ? "" : "  OVER THE PLAN");
        }
        say("    %-12s %9s / %9s %s\n", "total", MiB(host_peak_total).c_str(),
            MiB(plan.host_total_bytes()).c_str(),
            plan.host_memory_bytes() > 0
                ? absl::StrCat("of a ", MiB(plan.host_memory_bytes()), " MiB host cap").c_str()
                : "(no host cap)");
      }
    }
    for (absl::string_view line : absl::StrSplit(summary, '\n', absl::SkipEmpty())) {
      std::printf("%s", WrapLine(std::string(line), width).c_str());
    }
  }
  return ExitFor(final_state);
}

int Run(const Options& given) {
  ClientOptions co;
  co.timeout = given.timeout;
  unary_timeout = given.timeout;
  co.connection.address = given.coordinator;
  co.connection.files = given.files;
  co.connection.warn_plaintext_as = "plateauctl";
  const CommandHelp* command = FindCommand(given.command);
  if (command == nullptr) {
    return UsageError(absl::StrCat("plateauctl: unknown command '", given.command, "' (see plateauctl --help)"));
  }
  // The command line first: a usage error never waits for a coordinator.
  // A switch is on when given bare (main records "true") or =true, off
  // when =false.
  std::set<std::string> off;
  for (const auto& [name, values] : given.flags) {
    const FlagHelp* f = FindFlag(*command, name);
    if (f == nullptr) {
      return UsageError(absl::StrCat("plateauctl ", given.command, ": unknown flag --", name, " (see plateauctl ",
                                     given.command, " --help)"));
    }
    if (values.size() > 1 && !f->repeatable) {
      return UsageError(absl::StrCat("plateauctl ", given.command, ": --", name, " given ", values.size(),
                                     " times; expected once"));
    }
    if (f->value.empty()) {
      const std::string& v = values.back();
      if (v != "true" && v != "false") {
        return UsageError(absl::StrCat("plateauctl ", given.command, ": --", name,
                                       ": a switch; expected it bare, =true or =false, got '", v, "'"));
      }
      if (v == "false") off.insert(name);
    }
  }
  // What goes to the coordinator (labels, ids, selectors) is a proto3
  // string, which must be UTF-8: other bytes failed the call with an empty
  // INTERNAL after a libprotobuf line. Local paths (SPEC, FILE) may be any
  // bytes.
  for (const auto& [name, values] : given.flags) {
    if (FindFlag(*command, name)->value == "FILE") continue;
    for (const std::string& v : values) {
      if (!IsValidUtf8(v)) {
        return UsageError(absl::StrCat("plateauctl ", given.command, ": --", name, ": expected UTF-8 text, got '",
                                       ToValidUtf8(v), "' (bytes that are not UTF-8 shown as U+FFFD)"));
      }
    }
  }
  for (const std::string& arg : given.args) {
    if (command->args != "SPEC" && !IsValidUtf8(arg)) {
      return UsageError(absl::StrCat("plateauctl ", given.command, ": ", command->args, ": expected UTF-8 text, got '",
                                     ToValidUtf8(arg), "' (bytes that are not UTF-8 shown as U+FFFD)"));
    }
  }
  // From here on a switch given =false is not given.
  Options o = given;
  for (const std::string& name : off) o.flags.erase(name);
  const size_t want_args = command->args.empty() ? 0 : 1;
  if (o.args.size() != want_args) {
    return UsageError(absl::StrFormat("plateauctl %s: expected %d argument(s)%s, got %d (see plateauctl %s --help)",
                                      o.command, want_args, want_args ? absl::StrCat(" (", command->args, ")") : "",
                                      o.args.size(), o.command));
  }
  auto flag = [&](const std::string& name) { return o.flags.count(name) > 0; };
  auto value = [&](const std::string& name) { return o.flags.at(name).back(); };
  int64_t from = 0;
  if (flag("from") && (!absl::SimpleAtoi(value("from"), &from) || from < 0)) {
    return UsageError(absl::StrCat("plateauctl ", o.command, ": --from: expected an ",
                                   o.command == "logs" ? "index of a line" : "event index", " from 0 to ",
                                   std::numeric_limits<int64_t>::max(), ", got '", value("from"), "'"));
  }
  int32_t log_rank = 0;
  int64_t tail = -1;
  if (flag("rank") && o.command == "logs" && (!absl::SimpleAtoi(value("rank"), &log_rank) || log_rank < -1)) {
    return UsageError(absl::StrCat("plateauctl logs: --rank: expected a rank number >= 0, or -1 for the agent's "
                                   "lines, got '", value("rank"), "'"));
  }
  if (flag("tail") && (!absl::SimpleAtoi(value("tail"), &tail) || tail < 0)) {
    return UsageError(absl::StrCat("plateauctl logs: --tail: expected a number of lines from 0 to ",
                                   std::numeric_limits<int64_t>::max(), ", got '", value("tail"), "'"));
  }
  // A watch or log stream outlives a coordinator restart (client.h): say so
  // on stderr while it is away, so that a silent terminal is not a hang.
  // Under --output json it is an object too, so that a script reading
  // stderr line by line can parse every line (errors are objects there).
  co.on_reconnecting = [json = o.json](const absl::Status& s) {
    if (json) {
      std::fprintf(stderr, "{\"notice\":{\"kind\":\"reconnecting\",\"code\":%s,\"message\":%s}}\n",
                   JsonString(absl::StatusCodeToString(s.code())).c_str(),
                   JsonString(std::string(s.message())).c_str());
    } else if (absl::IsResourceExhausted(s)) {
      // Its limit of open streams per client host: a place frees when one
      // of them ends (Client retries with backoff).
      std::fprintf(stderr, "plateauctl: the coordinator refused the stream for now (%s); retrying with backoff...\n",
                   Visible(s.message()).c_str());
    } else {
      std::fprintf(stderr,
                   "\nplateauctl: the coordinator went away (%s); reconnecting... (resuming from the next "
                   "event)\n",
                   Visible(s.message()).c_str());
    }
    std::fflush(stderr);
  };
  Client client(co);
  if (!client.status().ok()) return Report(client.status());
  if (o.command == "submit" || o.command == "plan") {
    // A file that cannot be read or parsed is this command's error, said as
    // a usage error is ("plateauctl submit: job.txtpb:2:11: ..."), not with
    // a status code that reads as the coordinator's refusal.
    auto spec = ReadSpec(o.args[0]);
    if (!spec.ok()) return UsageError(Visible(absl::StrCat("plateauctl ", o.command, ": ", spec.status().message())));
    if (o.command == "plan") {
      auto plan = client.PlanJob(*spec);
      if (!plan.ok()) return Report(plan.status());
      if (o.json) {
        std::printf("%s\n", Json(*plan).c_str());
      } else {
        PrintPlan(plan->plan());
      }
      // A plan that does not fit is an answer, but not a yes: scripts see it.
      return plan->plan().fits() ? kExitOk : kExitDoesNotFit;
    }
    v1::SubmitJobRequest req;
    if (flag("label")) {
      std::set<std::string> keys;
      for (const std::string& kv : o.flags.at("label")) {
        const size_t eq = kv.find('=');
        if (eq == std::string::npos) {
          return UsageError(absl::StrCat("plateauctl submit: --label: expected KEY=VALUE, got '", kv, "'"));
        }
        const std::string key = kv.substr(0, eq);
        if (!keys.insert(key).second) {
          return UsageError(absl::StrCat("plateauctl submit: --label: the key '", key,
                                         "' is given twice; a label has one value"));
        }
        // The coordinator checks the key and the value (naming them).
        (*spec->mutable_labels())[key] = kv.substr(eq + 1);
      }
    }
    if (flag("priority")) {
      int32_t priority = 0;
      if (!absl::SimpleAtoi(value("priority"), &priority)) {
        return UsageError(absl::StrCat("plateauctl submit: --priority: expected an integer (-1000 to 1000), got '",
                                       value("priority"), "'"));
      }
      spec->set_priority(priority);
    }
    if (flag("max-duration")) {
      int64_t seconds = 0;
      // The range is the job spec's (worker/job_spec.cc), checked by the coordinator.
      if (!absl::SimpleAtoi(value("max-duration"), &seconds) || seconds < 0) {
        return UsageError(absl::StrCat("plateauctl submit: --max-duration: expected whole seconds, 0 (no limit) up "
                                       "to a year, got '",
                                       value("max-duration"), "'"));
      }
      spec->set_max_duration_s(seconds);
    }
    *req.mutable_spec() = *spec;
    req.set_validate_only(flag("validate-only"));
    req.set_request_id(flag("request-id") ? value("request-id") : NewRequestId());
    absl::StatusOr<v1::SubmitJobResponse> resp = client.SubmitJob(req);
    // A lost answer (the coordinator went away, or answered too late) may
    // have created the job: the same request id makes the retry return it.
    for (int retry = 0; retry < 2 && !req.request_id().empty() && !resp.ok() &&
                        resp.status().code() == absl::StatusCode::kUnavailable;
         ++retry) {
      absl::SleepFor(absl::Seconds(1));
      resp = client.SubmitJob(req);
    }
    if (!resp.ok()) {
      // Admission's refusal of a plan over a cap, or of `auto` settings of
      // which no value fits (worker/job_spec.h AdmitJob): by its type.
      const bool does_not_fit = DoesNotFitOf(resp.status()).has_value();
      return does_not_fit ? Fail(resp.status(), kExitDoesNotFit) : Report(resp.status());
    }
    if (o.json) {
      std::printf("%s\n", Json(*resp).c_str());
    } else {
      // The plan is most of what a submit prints (~35 lines with its N_max
      // table); a script or a user who has seen it wants the id.
      if (!flag("quiet")) PrintPlan(resp->plan());
      if (flag("validate-only")) {
        std::printf("valid: nothing was created (--validate-only)\n");
      } else {
        std::printf("submitted %s: %s (%s)\n", resp->job().id().c_str(), v1::JobState_Name(resp->job().state()).c_str(),
                    Visible(resp->job().state_reason()).c_str());
      }
    }
    std::fflush(stdout);
    if (flag("wait") && !flag("validate-only")) return Watch(client, o, resp->job().id(), 0);
    return kExitOk;
  }
  if (o.command == "get") {
    auto job = client.GetJob(o.args[0]);
    if (!job.ok()) return Report(job.status());
    if (o.json) {
      std::printf("%s\n", Json(*job).c_str());
    } else {
      PrintJob(*job);
    }
    return kExitOk;
  }
  if (o.command == "list") {
    v1::ListJobsRequest req;
    if (flag("state")) {
      for (absl::string_view s : absl::StrSplit(value("state"), ',')) {
        v1::JobState st;
        if (!v1::JobState_Parse(absl::AsciiStrToUpper(s), &st) || st == v1::JOB_STATE_UNSPECIFIED) {
          return UsageError(absl::StrCat("plateauctl list: --state: '", s,
                                         "' is not a job state (PENDING, SCHEDULED, RUNNING, SUCCEEDED, FAILED, "
                                         "CANCELLING, CANCELLED, RESTARTING)"));
        }
        req.add_states(st);
      }
    }
    // Repeated selectors must all hold: one selector, joined.
    if (flag("label")) req.set_label_selector(absl::StrJoin(o.flags.at("label"), ","));
    req.set_newest_first(flag("newest-first"));
    if (flag("page_size")) {
      int32_t n = 0;
      // Its range is the coordinator's to check (ListJobs names it).
      if (!absl::SimpleAtoi(value("page_size"), &n)) {
        return UsageError(absl::StrCat("plateauctl list: --page_size: expected a number of jobs per page, 0 (the "
                                       "default, 50) to 1000, got '",
                                       value("page_size"), "'"));
      }
      req.set_page_size(n);
    }
    if (flag("page_token")) req.set_page_token(value("page_token"));
    v1::ListJobsResponse all;
    do {
      auto page = client.ListJobs(req);
      if (!page.ok()) return Report(page.status());
      for (const v1::Job& j : page->jobs()) *all.add_jobs() = j;
      all.set_next_page_token(page->next_page_token());
      req.set_page_token(page->next_page_token());
    } while (flag("all") && !req.page_token().empty());
    if (o.json) {
      std::printf("%s\n", Json(all).c_str());
      return kExitOk;
    }
    // A long reason (a failure's message) would wrap into the next row:
    // each row is cut to the terminal width.
    // Labels (sorted, k=v joined by commas) get a column of their own, cut
    // to 24 columns with "..." so that the reason keeps its place.
    const int width = TerminalWidth();
    auto labels_of = [](const v1::Job& j) {
      std::map<std::string, std::string> sorted(j.spec().labels().begin(), j.spec().labels().end());
      return sorted.empty() ? std::string("-") : absl::StrJoin(sorted, ",", absl::PairFormatter("="));
    };
    std::printf("%s\n", FitLine(absl::StrFormat("%-10s %-11s %-16s %-12s %-24s %s", "JOB", "STATE", "NAME", "STEP",
                                                 "LABELS", "REASON"),
                                 width)
                             .c_str());
    for (const v1::Job& j : all.jobs()) {
      std::printf("%s\n", FitLine(absl::StrFormat("%-10s %-11s %s %-12s %s %s", j.id(), v1::JobState_Name(j.state()),
                                                  Cell(j.spec().name(), 16),
                                                  absl::StrCat(j.progress().step(), "/", j.spec().steps()),
                                                  Cell(labels_of(j), 24), Visible(j.state_reason())),
                                  width)
                              .c_str());
    }
    if (!all.next_page_token().empty()) {
      std::printf("more: --page_token=%s (or --all)\n", all.next_page_token().c_str());
    }
    return kExitOk;
  }
  if (o.command == "watch") {
    return Watch(client, o, o.args[0], from);
  }
  if (o.command == "logs") {
    // A rank the job does not have would print nothing, as a quiet job
    // does: said instead, as `memory --rank` says it; so are logs the
    // retention pass removed.
    auto job = client.GetJob(o.args[0]);
    if (!job.ok()) return Report(job.status());
    if (job->has_events_deleted_time()) {  // the stream would be refused: nothing is left
      SayRemoved(*job, o.json, "logs");
      return kExitOk;
    }
    if (flag("rank") && log_rank >= 0) {
      const int64_t ranks = job->spec().layout().ranks();
      if (log_rank >= ranks) {
        return UsageError(
            absl::StrCat("plateauctl logs: --rank: ", o.args[0], " has ranks 0 to ", ranks - 1,
                         " (and -1 for the agent's and the coordinator's lines), got ", log_rank));
      }
    }
    auto print = [&](const v1::LogEntry& l) {
      const std::string at = flag("timestamps") ? absl::StrCat(Time(l.time()), " ") : "";
      if (o.json) {
        std::printf("%s\n", Json(l).c_str());
      } else if (l.rank() < 0) {  // the agent's or the coordinator's own line: say whose
        std::printf("%s[%s] %s\n", at.c_str(), l.stream().empty() ? "agent" : l.stream().c_str(),
                    flag("raw") ? l.line().c_str() : Visible(l.line()).c_str());
      } else {
        std::printf("%s[rank %d] %s\n", at.c_str(), l.rank(),
                    flag("raw") ? l.line().c_str() : Visible(l.line()).c_str());
      }
      std::fflush(stdout);
    };
    // Filtered here: the coordinator streams every rank's lines.
    auto wanted = [&](const v1::LogEntry& l) { return !flag("rank") || l.rank() == log_rank; };
    if (tail < 0) {
      absl::Status s = client.GetJobLogs(o.args[0], flag("follow"), from, [&](const v1::LogEntry& l) {
        if (wanted(l)) print(l);
        return true;
      });
      return s.ok() ? kExitOk : Report(s);
    }
    // --tail: read what exists (no follow), keep the last N wanted lines,
    // print them; with --follow, then stream from the line after the last
    // one read.
    std::deque<v1::LogEntry> last;
    int64_t next = from;
    absl::Status s = client.GetJobLogs(o.args[0], /*follow=*/false, from, [&](const v1::LogEntry& l) {
      next = l.index() + 1;
      if (!wanted(l) || tail == 0) return true;
      last.push_back(l);
      if (static_cast<int64_t>(last.size()) > tail) last.pop_front();
      return true;
    });
    if (!s.ok()) return Report(s);
    for (const v1::LogEntry& l : last) print(l);
    if (!flag("follow")) return kExitOk;
    s = client.GetJobLogs(o.args[0], /*follow=*/true, next, [&](const v1::LogEntry& l) {
      if (wanted(l)) print(l);
      return true;
    });
    return s.ok() ? kExitOk : Report(s);
  }
  if (o.command == "memory") {
    int rank = 0, width = 64;
    if (flag("rank") && (!absl::SimpleAtoi(value("rank"), &rank) || rank < 0)) {
      return UsageError(absl::StrCat("plateauctl memory: --rank: expected a rank number >= 0, got '", value("rank"),
                                     "'"));
    }
    if (flag("width") && (!absl::SimpleAtoi(value("width"), &width) || width < 10 || width > 1000)) {
      return UsageError(absl::StrCat("plateauctl memory: --width: expected 10 to 1000 columns, got '",
                                     value("width"), "'"));
    }
    // Under --output json the timeline is the data itself, every rank's or
    // --rank's: there is no chart to size or draw.
    if (o.json && (flag("png") || flag("width"))) {
      return UsageError(absl::StrCat("plateauctl memory: --", flag("png") ? "png" : "width",
                                     " draws a chart; --output json prints the timeline as data (give one of them)"));
    }
    auto timeline = client.GetMemoryTimeline(o.args[0]);
    if (!timeline.ok()) return Report(timeline.status());
    // A --rank the job has no timeline of is the flag's fault: a usage error
    // (MemoryCharts says which ranks have one).
    if (o.json && flag("rank")) {  // that rank's timeline alone
      auto& ranks = *timeline->mutable_ranks();
      auto it = std::find_if(ranks.begin(), ranks.end(), [&](const v1::MemoryTimeline& t) { return t.rank() == rank; });
      if (it == ranks.end()) return Fail(AsUsage(MemoryCharts(*timeline, rank).status()), kExitUsage);
      v1::MemoryTimeline one = std::move(*it);
      ranks.Clear();
      *ranks.Add() = std::move(one);
    }
    if (o.json) {
      std::printf("%s\n", Json(*timeline).c_str());
      return kExitOk;
    }
    auto charts = MemoryCharts(*timeline, rank);
    if (!charts.ok()) return Fail(AsUsage(charts.status()), kExitUsage);
    if (flag("png")) {
      const std::string path = value("png");
      if (path.empty()) return UsageError("plateauctl memory: --png: expected a file name to write, got ''");
      absl::Status written = chart::WritePng(MemoryChartsCanvas(*charts), path);
      if (!written.ok()) return Fail(written, kExitUsage);
      std::printf("wrote %s (%zu panel(s): %s)\n", path.c_str(), charts->size(),
                  charts->size() > 1 ? "device, host" : "device");
      return kExitOk;
    }
    for (size_t i = 0; i < charts->size(); ++i) {
      std::printf("%s%s", i > 0 ? "\n" : "", TerminalChart((*charts)[i], width).c_str());
    }
    return kExitOk;
  }
  if (o.command == "workers") {
    auto workers = client.ListWorkers();
    if (!workers.ok()) return Report(workers.status());
    if (o.json) {
      std::printf("%s\n", Json(*workers).c_str());
      return kExitOk;
    }
    // ADDRESS holds an IPv4 address with its port (21 characters) whole.
    std::printf("%-10s %-16s %-21s %-7s %-10s %-12s %-12s %-10s %s\n", "WORKER", "NAME", "ADDRESS", "BACKEND", "SLOTS",
                "DEVICE MiB", "HOST MiB", "HEARTBEAT", "JOBS");
    const absl::Time now = absl::Now();
    for (const v1::WorkerInfo& w : workers->workers()) {
      const absl::Time beat = absl::FromUnixSeconds(w.last_heartbeat().seconds()) +
                              absl::Nanoseconds(w.last_heartbeat().nanos());
      std::string jobs = absl::StrJoin(w.running_jobs(), ",");
      if (w.state() != "attached") jobs = absl::StrCat("(", w.state(), ") ", jobs);
      std::printf(
          "%-10s %s %s %-7s %-10s %-12s %-12s %-10s %s\n", w.id().c_str(), Cell(w.name(), 16).c_str(),
          Cell(w.address(), 21).c_str(), w.backend() == v1::BACKEND_CUDA ? "cuda" : "cpu",
          absl::StrCat(w.slots_free(), "/", w.slots_total(), " free").c_str(), MiB(w.device_memory_bytes()).c_str(),
          w.host_memory_bytes() > 0 ? MiB(w.host_memory_bytes()).c_str() : "-",
          absl::StrFormat("%.1fs ago", absl::ToDoubleSeconds(now - beat)).c_str(), jobs.empty() ? "-" : jobs.c_str());
    }
    return kExitOk;
  }
  if (o.command == "delete") {
    absl::Status s = client.DeleteJob(o.args[0]);
    if (!s.ok()) {
      return Report(s, absl::StrCat("; a delete the coordinator received runs on to its end (plateauctl get ",
                                    o.args[0], ": NOT_FOUND once it is done)"));
    }
    if (o.json) {
      std::printf("{\"job_id\":\"%s\",\"deleted\":true}\n", o.args[0].c_str());
    } else {
      std::printf("%s deleted\n", o.args[0].c_str());
    }
    return kExitOk;
  }
  if (o.command == "cancel") {
    auto job = client.CancelJob(o.args[0]);
    // CancelJob's FAILED_PRECONDITION: the job is SUCCEEDED or FAILED
    // already (a CANCELLED one is answered OK: a retried cancel).
    if (!job.ok() && job.status().code() == absl::StatusCode::kFailedPrecondition) {
      return Fail(job.status(), kExitAlreadyFinished);
    }
    if (!job.ok()) return Report(job.status());
    if (o.json) {
      std::printf("%s\n", Json(*job).c_str());
    } else {
      std::printf("%s %s: %s\n", job->id().c_str(), v1::JobState_Name(job->state()).c_str(),
                  Visible(job->state_reason()).c_str());
    }
    return kExitOk;
  }
  return UsageError(absl::StrCat("plateauctl: unknown command '", o.command, "' (see plateauctl --help)"));
}

}  // namespace
}  // namespace plateau

int main(int argc, char** argv) {
  using plateau::kExitUsage;
  plateau::Options o;
  const char* env = std::getenv("PLATEAU_COORDINATOR");
  o.coordinator = env && *env ? env : "127.0.0.1:7070";
  const char* token = std::getenv("PLATEAU_TOKEN_FILE");
  o.files.token_file = token ? token : "";
  const char* ca = std::getenv("PLATEAU_TLS_CA_FILE");
  o.files.tls_ca_file = ca ? ca : "";
  const char* cert = std::getenv("PLATEAU_TLS_CLIENT_CERT_FILE");
  o.files.tls_client_cert_file = cert ? cert : "";
  const char* key = std::getenv("PLATEAU_TLS_CLIENT_KEY_FILE");
  o.files.tls_client_key_file = key ? key : "";
  // --output first: the errors of the rest of the command line follow it.
  for (int i = 1; i < argc; ++i) {
    if (std::string(argv[i]) == "--output=json" ||
        (std::string(argv[i]) == "--output" && i + 1 < argc && std::string(argv[i + 1]) == "json")) {
      plateau::json_errors = true;
    }
  }
  // gRPC logs some failures itself (a TLS handshake with a plaintext
  // coordinator: "E... ssl_transport_security.cc ... Handshake failed")
  // before the call's status says the same; under --output json every
  // stderr line must be one JSON object, so gRPC's own lines are dropped.
  if (plateau::json_errors) gpr_set_log_function([](gpr_log_func_args*) {});
  bool help = false;
  std::string usage_error;
  std::set<std::string> globals_seen;
  bool cert_flag = false, key_flag = false;  // given on the command line, not by the environment
  // The command is found first, so that a flag before it is parsed as the
  // command's own (`plateauctl --tail 5 logs job-1`: --tail takes 5).
  const int command_at = plateau::CommandIndex(argc, argv);
  if (command_at > 0) o.command = argv[command_at];
  bool flags_ended = false;  // after "--" every argument is positional
  // Where the last flag given bare was, when the command does not know it
  // (else -1): a word after it before the command is its stray value.
  int unknown_flag_at = -1;
  for (int i = 1; i < argc; ++i) {
    if (i == command_at) continue;
    std::string arg = argv[i];
    if (!flags_ended && arg == "--") {
      flags_ended = true;
      continue;
    }
    if (!flags_ended && (arg == "--help" || arg == "-h")) {
      help = true;
      continue;
    }
    if (!flags_ended && arg == "-f") arg = "--follow";
    if (flags_ended || arg.rfind("--", 0) != 0) {
      // A word before the command that no flag took as its value is a
      // mistyped command (`plateauctl lgos get job-1`), not an argument.
      if (!flags_ended && i < command_at && usage_error.empty()) {
        // ... unless it follows a flag the command does not have (a typo,
        // or another command's flag: `--tial 5 logs`), which is the error.
        usage_error = unknown_flag_at >= 0 && i == unknown_flag_at + 1
                          ? absl::StrCat("plateauctl ", o.command, ": unknown flag ", argv[unknown_flag_at])
                          : absl::StrCat("plateauctl: unknown command '", arg, "' (the commands: plateauctl --help)");
      }
      o.args.push_back(arg);
      continue;
    }
    const size_t eq = arg.find('=');
    std::string name = arg.substr(2, eq == std::string::npos ? std::string::npos : eq - 2);
    if (name == "f") name = "follow";
    // A bare flag is a switch turned on: "true", as if given --name=true
    // (so that Run tells it from --name=, which says nothing).
    std::string value = eq == std::string::npos ? "true" : arg.substr(eq + 1);
    // "--name value" for a flag that takes one: the next argument.
    const plateau::CommandHelp* command = plateau::FindCommand(o.command);
    name = plateau::CanonicalFlagName(command, name);
    const plateau::FlagHelp* f = command != nullptr ? plateau::FindFlag(*command, name) : nullptr;
    const bool takes_value = plateau::IsGlobalFlag(name) || (f != nullptr && !f->value.empty());
    if (eq == std::string::npos && !takes_value) unknown_flag_at = f == nullptr ? i : -1;
    if (eq == std::string::npos && takes_value) {
      // `--tail logs JOB`: the command is no value; nor is "--".
      if (i + 1 >= argc || i + 1 == command_at || std::string(argv[i + 1]) == "--") {
        if (usage_error.empty()) usage_error = absl::StrCat("plateauctl: --", name, ": expected a value");
        continue;
      }
      value = argv[++i];
    }
    if (plateau::IsGlobalFlag(name) && !globals_seen.insert(name).second && usage_error.empty()) {
      usage_error = absl::StrCat("plateauctl: --", name, " given more than once; expected once");
    }
    if (name == "coordinator") {
      o.coordinator = value;
    } else if (name == "token_file") {
      o.files.token_file = value;
    } else if (name == "tls_ca_file") {
      o.files.tls_ca_file = value;
    } else if (name == "tls_client_cert_file") {
      o.files.tls_client_cert_file = value;
      cert_flag = true;
    } else if (name == "tls_client_key_file") {
      o.files.tls_client_key_file = value;
      key_flag = true;
    } else if (name == "timeout") {
      double seconds = 0;
      if (!absl::SimpleAtod(value, &seconds) || !std::isfinite(seconds) || seconds <= 0 || seconds > 3600) {
        if (usage_error.empty()) {
          usage_error =
              absl::StrCat("plateauctl: --timeout: expected seconds above 0, at most 3600, got '", value, "'");
        }
      } else {
        o.timeout = absl::Seconds(seconds);
      }
    } else if (name == "output") {
      if (value != "json" && value != "text" && usage_error.empty()) {
        usage_error = absl::StrCat("plateauctl: --output: expected text or json, got '", value, "'");
      }
      o.json = value == "json";
    } else {
      o.flags[name].push_back(value);
    }
  }
  if (o.command == "help") {  // "plateauctl help [COMMAND]"
    help = true;
    o.command = o.args.empty() ? "" : o.args[0];
    o.args.clear();
  }
  if (help) {
    if (o.command.empty()) {
      std::fputs(plateau::Usage().c_str(), stdout);
      return 0;
    }
    const plateau::CommandHelp* command = plateau::FindCommand(o.command);
    if (command == nullptr) {
      return plateau::UsageError(
          absl::StrCat("plateauctl: unknown command '", o.command, "' (the commands: plateauctl --help)"));
    }
    std::fputs(plateau::CommandUsage(*command).c_str(), stdout);
    return 0;
  }
  if (!usage_error.empty()) return plateau::UsageError(usage_error);
  // The environment's client certificate is a standing default: with TLS
  // off it is left unused (a plaintext coordinator asks for none), where
  // the flags would be an error (client/connection.h: only over TLS).
  if (o.files.tls_ca_file.empty()) {
    if (!cert_flag) o.files.tls_client_cert_file.clear();
    if (!key_flag) o.files.tls_client_key_file.clear();
  }
  if (o.files.tls_client_cert_file.empty() != o.files.tls_client_key_file.empty()) {
    const bool no_key = o.files.tls_client_key_file.empty();
    return plateau::UsageError(
        absl::StrCat("plateauctl: a client certificate needs both --tls_client_cert_file and --tls_client_key_file; ",
                     no_key ? "--tls_client_key_file (or $PLATEAU_TLS_CLIENT_KEY_FILE)"
                            : "--tls_client_cert_file (or $PLATEAU_TLS_CLIENT_CERT_FILE)",
                     " is missing, and ", no_key ? "the certificate" : "the key", " came from ",
                     (no_key ? cert_flag : key_flag) ? "its flag" : "the environment"));
  }
  if (o.command.empty() && !o.flags.empty()) {
    return plateau::UsageError(absl::StrCat("plateauctl: --", o.flags.begin()->first,
                                            ": not a global flag, and no command given (see plateauctl --help)"));
  }
  if (o.command.empty()) {
    if (plateau::json_errors) return plateau::UsageError("plateauctl: expected a command (see plateauctl --help)");
    std::fputs(plateau::Usage().c_str(), stderr);
    return kExitUsage;
  }
  return plateau::Run(o);
}
