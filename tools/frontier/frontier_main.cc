// Writes the frontier table between the markers of docs/FRONTIER.md and the
// chart to docs/frontier.png (ComputeFrontier, tools/frontier/frontier.h).
//   bazel run //tools/frontier -- --doc=$PWD/docs/FRONTIER.md --png=$PWD/docs/frontier.png
// Without flags it prints the table.
#include <chrono>
#include <cstdio>
#include <fstream>
#include <sstream>
#include <string>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "client/chart/png.h"
#include "tools/frontier/frontier.h"
#include "tools/frontier/frontier_doc.h"

int main(int argc, char** argv) {
  std::string doc, png;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (absl::StartsWith(a, "--doc=")) {
      doc = a.substr(6);
    } else if (absl::StartsWith(a, "--png=")) {
      png = a.substr(6);
    } else {
      std::fprintf(stderr, "usage: frontier [--doc=docs/FRONTIER.md] [--png=docs/frontier.png]\n");
      return 2;
    }
  }
  const auto t0 = std::chrono::steady_clock::now();
  auto rows = plateau::ComputeFrontier();
  if (!rows.ok()) {
    std::fprintf(stderr, "frontier: %s\n", rows.status().ToString().c_str());
    return 1;
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const std::string table = plateau::FrontierTable(*rows);
  std::printf("%s", table.c_str());
  std::printf("(solved in %.2f s)\n", seconds);
  if (!doc.empty()) {
    std::ifstream in(doc);
    std::stringstream text;
    text << in.rdbuf();
    auto replaced = plateau::ReplaceFrontierTable(text.str(), table);
    if (!in || !replaced.ok()) {
      std::fprintf(stderr, "frontier: %s: %s\n", doc.c_str(),
                   in ? replaced.status().ToString().c_str() : "cannot read");
      return 1;
    }
    std::ofstream out(doc, std::ios::trunc);
    out << *replaced;
    if (!out) {
      std::fprintf(stderr, "frontier: %s: cannot write\n", doc.c_str());
      return 1;
    }
  }
  if (!png.empty()) {
    if (absl::Status s = plateau::chart::WritePng(plateau::FrontierPlot(*rows), png); !s.ok()) {
      std::fprintf(stderr, "frontier: %s\n", s.ToString().c_str());
      return 1;
    }
  }
  return 0;
}
