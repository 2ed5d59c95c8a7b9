// The memory timeline of a real job end to end: a real coordinator and
// worker run a small job (two ranks, SCO and OffloadStreamAdamW on, so it
// has host live sets too) to the end, recording its timeline at steps 1 and
// 2; then
//   - GetMemoryTimeline (gRPC) returns both ranks' latest timeline, every
//     phase from the embedding to the optimizer, each live set's measured
//     peak within its plan, and NOT_FOUND / FAILED_PRECONDITION saying why
//     for an unknown job and a job that records none;
//   - plateauctl memory prints the terminal charts and --output json;
//   - Debian's chromium, headless, loads /jobs/ID/memory: the DOM it built
//     draws every live set the job held and every bound of its plan, on the
//     device and the host chart, and its screenshot is not blank (decoded
//     here: many colours, the weights band's among them).
#include <unistd.h>
#include <zlib.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <set>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/cluster.h"

namespace plateau {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;
using namespace testing_cluster;  // NOLINT: the harness is this file's vocabulary

constexpr char kChromium[] = "/usr/bin/chromium";

// ---------------------------------------------------------------------------
// Just enough PNG to count a screenshot's colours: 8-bit RGB or RGBA,
// not interlaced (what Chromium writes), the five scanline filters.

struct Image {
  int width = 0, height = 0;
  std::vector<uint32_t> pixels;  // 0xRRGGBB
};

uint32_t BigEndian32(const std::string& b, size_t at) {
  return (static_cast<uint32_t>(static_cast<uint8_t>(b[at])) << 24) |
         (static_cast<uint32_t>(static_cast<uint8_t>(b[at + 1])) << 16) |
         (static_cast<uint32_t>(static_cast<uint8_t>(b[at + 2])) << 8) | static_cast<uint8_t>(b[at + 3]);
}

int Paeth(int a, int b, int c) {
  const int p = a + b - c, pa = std::abs(p - a), pb = std::abs(p - b), pc = std::abs(p - c);
  return pa <= pb && pa <= pc ? a : pb <= pc ? b : c;
}

absl::StatusOr<Image> DecodePng(const std::string& file) {
  if (file.size() < 8 || file.compare(0, 8, "\x89PNG\r\n\x1a\n") != 0) {
    return absl::InvalidArgumentError("not a PNG (signature)");
  }
  Image img;
  int depth = 0, color = 0, interlace = 0;
  std::string idat;
  for (size_t at = 8; at + 12 <= file.size();) {
    const uint32_t len = BigEndian32(file, at);
    const std::string type = file.substr(at + 4, 4);
    if (at + 12 + len > file.size()) return absl::InvalidArgumentError("truncated chunk " + type);
    const std::string data = file.substr(at + 8, len);
    if (type == "IHDR") {
      img.width = static_cast<int>(BigEndian32(data, 0));
      img.height = static_cast<int>(BigEndian32(data, 4));
      depth = static_cast<uint8_t>(data[8]);
      color = static_cast<uint8_t>(data[9]);
      interlace = static_cast<uint8_t>(data[12]);
    } else if (type == "IDAT") {
      idat += data;
    } else if (type == "IEND") {
      break;
    }
    at += 12 + len;
  }
  if (depth != 8 || (color != 2 && color != 6) || interlace != 0 || img.width <= 0 || img.height <= 0) {
    return absl::UnimplementedError(absl::StrCat("PNG depth ", depth, " colour type ", color, " interlace ",
                                                 interlace, " (this reader: 8-bit RGB/RGBA, not interlaced)"));
  }
  const int bpp = color == 6 ? 4 : 3;
  const size_t stride = static_cast<size_t>(img.width) * bpp;
  std::string raw((stride + 1) * img.height, '\0');
  uLongf raw_len = raw.size();
  if (uncompress(reinterpret_cast<Bytef*>(raw.data()), &raw_len, reinterpret_cast<const Bytef*>(idat.data()),
                 idat.size()) != Z_OK ||
      raw_len != raw.size()) {
    return absl::InvalidArgumentError("IDAT does not inflate to the image's size");
  }
  std::vector<uint8_t> prev(stride, 0), cur(stride);
  img.pixels.reserve(static_cast<size_t>(img.width) * img.height);
  for (int y = 0; y < img.height; ++y) {
    const uint8_t filter = static_cast<uint8_t>(raw[y * (stride + 1)]);
    const uint8_t* in = reinterpret_cast<const uint8_t*>(raw.data()) + y * (stride + 1) + 1;
    for (size_t i = 0; i < stride; ++i) {
      const int a = i >= static_cast<size_t>(bpp) ? cur[i - bpp] : 0, b = prev[i],
                c = i >= static_cast<size_t>(bpp) ? prev[i - bpp] : 0;
      int pred = 0;
      switch (filter) {
        case 0: pred = 0; break;
        case 1: pred = a; break;
        case 2: pred = b; break;
        case 3: pred = (a + b) / 2; break;
        case 4: pred = Paeth(a, b, c); break;
        default: return absl::InvalidArgumentError(absl::StrCat("row ", y, ": filter ", filter));
      }
      cur[i] = static_cast<uint8_t>(in[i] + pred);
    }
    for (int x = 0; x < img.width; ++x) {
      const uint8_t* p = &cur[static_cast<size_t>(x) * bpp];
      img.pixels.push_back((static_cast<uint32_t>(p[0]) << 16) | (static_cast<uint32_t>(p[1]) << 8) | p[2]);
    }
    prev.swap(cur);
  }
  return img;
}

// Pixels within `tolerance` of `rgb` in every channel.
int64_t CountNear(const Image& img, uint32_t rgb, int tolerance) {
  int64_t n = 0;
  for (uint32_t p : img.pixels) {
    bool near = true;
    for (int shift : {16, 8, 0}) near = near && std::abs(static_cast<int>((p >> shift) & 0xff) -
                                                         static_cast<int>((rgb >> shift) & 0xff)) <= tolerance;
    n += near;
  }
  return n;
}

// ---------------------------------------------------------------------------

// Chromium headless on `url` with `mode` ("--dump-dom" or "--screenshot=PATH").
Ran Chromium(const std::string& dir, const std::string& mode, const std::string& url) {
  std::vector<std::string> args = {kChromium, "--headless", "--disable-gpu", "--disable-dev-shm-usage",
                                   "--no-first-run", "--hide-scrollbars", "--window-size=1100,1400",
                                   "--user-data-dir=" + dir + "/chromium-profile", mode, url};
  // Chromium refuses to run as root with its sandbox on (a container's usual user).
  if (geteuid() == 0) args.insert(args.begin() + 1, "--no-sandbox");
  return RunCommand(args, dir + "/chromium" + std::to_string(mode.size()));
}

class MemoryPageTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    cluster_ = new Cluster("memory-page");
    if (!cluster_->ready()) return;
    v1::JobSpec spec = TinyJob(3);
    spec.set_memory_timeline_every(2);  // steps 1 and 2
    auto sub = cluster_->client().SubmitJob(spec, false);
    if (!sub.ok()) return;
    job_ = new v1::Job(cluster_->WaitDone(sub->job().id()));
  }
  static void TearDownTestSuite() {
    delete job_;
    delete cluster_;
  }
  void SetUp() override {
    ASSERT_TRUE(cluster_->ready()) << cluster_->Logs();
    ASSERT_NE(job_, nullptr) << cluster_->Logs();
    ASSERT_EQ(job_->state(), v1::SUCCEEDED) << job_->DebugString() << cluster_->Logs();
  }

  static Cluster* cluster_;
  static v1::Job* job_;
};
Cluster* MemoryPageTest::cluster_ = nullptr;
v1::Job* MemoryPageTest::job_ = nullptr;

TEST_F(MemoryPageTest, RpcReturnsEachRanksLatestTimelineWithinThePlan) {
  auto t = cluster_->client().GetMemoryTimeline(job_->id());
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ(t->job_id(), job_->id());
  EXPECT_EQ(t->plan().total_bytes(), job_->plan().total_bytes());
  ASSERT_EQ(t->ranks_size(), 2);
  for (int r = 0; r < 2; ++r) {
    const v1::MemoryTimeline& m = t->ranks(r);
    EXPECT_EQ(m.rank(), r);
    EXPECT_EQ(m.step(), 2) << "the latest of steps 1 and 2";
    EXPECT_EQ(m.device_cap_bytes(), job_->spec().device_memory_bytes());
    ASSERT_EQ(m.live_sets_size(), 8);
    // 2 layers: embedding, 2 forward, projection x2, 2 x (recompute, backward),
    // grad reduce, grad norm, the optimizer's buckets, optimizer.
    ASSERT_GE(m.phases_size(), 12);
    EXPECT_EQ(m.phases_seen(), m.phases_size());
    EXPECT_EQ(m.phases(0).name(), "embedding");
    EXPECT_EQ(m.phases(1).name(), "forward 0");
    EXPECT_EQ(m.phases(m.phases_size() - 1).name(), "optimizer");
    EXPECT_EQ(m.phases(m.phases_size() - 2).name().rfind("optimizer bucket ", 0), 0u);
    // Measured <= planned, for every live set in every phase, device and host.
    for (const v1::LiveSetBytes& b : t->plan().live_sets()) {
      const int i = static_cast<int>(std::find(m.live_sets().begin(), m.live_sets().end(), b.live_set()) -
                                     m.live_sets().begin());
      ASSERT_LT(i, 8) << b.live_set();
      for (const v1::MemoryTimelinePhase& p : m.phases()) {
        EXPECT_LE(p.device_peak_bytes(i), b.bytes()) << b.live_set() << " in " << p.name();
      }
    }
    for (const v1::LiveSetBytes& b : t->plan().host_live_sets()) {
      const int i = static_cast<int>(std::find(m.live_sets().begin(), m.live_sets().end(), b.live_set()) -
                                     m.live_sets().begin());
      for (const v1::MemoryTimelinePhase& p : m.phases()) {
        EXPECT_LE(p.host_peak_bytes(i), b.bytes()) << b.live_set() << " in " << p.name();
      }
    }
    EXPECT_GT(m.phases(0).host_bytes(2), 0) << "OffloadStreamAdamW keeps the optimizer state on the host";
  }
  auto unknown = cluster_->client().GetMemoryTimeline("job-999");
  EXPECT_EQ(unknown.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(unknown.status().message(), HasSubstr("job-999"));
}

TEST_F(MemoryPageTest, AJobThatRecordsNoneSaysSo) {
  v1::JobSpec spec = TinyJob(1);
  spec.set_memory_timeline_every(0);
  auto sub = cluster_->client().SubmitJob(spec, false);
  ASSERT_TRUE(sub.ok()) << sub.status();
  ASSERT_EQ(cluster_->WaitDone(sub->job().id()).state(), v1::SUCCEEDED) << cluster_->Logs();
  auto none = cluster_->client().GetMemoryTimeline(sub->job().id());
  EXPECT_EQ(none.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(none.status().message(), HasSubstr("memory_timeline_every: 0"));
  const std::string page = HttpGet(cluster_->metrics(), absl::StrCat("/jobs/", sub->job().id(), "/memory"));
  EXPECT_EQ(HttpStatus(page), 404);
  EXPECT_THAT(page, HasSubstr("memory_timeline_every: 0"));
  EXPECT_EQ(HttpStatus(HttpGet(cluster_->metrics(), "/jobs/job-999/memory")), 404);
}

TEST_F(MemoryPageTest, PlateauctlPrintsTheChartsAndJson) {
  const std::string dir = cluster_->dir();
  Ran text = RunCommand({"client/plateauctl", "--coordinator=" + cluster_->api(), "memory", job_->id(), "--rank=1",
                         "--width=50"},
                        dir + "/ctl-memory");
  ASSERT_EQ(text.code, 0) << text.out << text.err;
  EXPECT_THAT(text.out, HasSubstr(absl::StrCat(job_->id(), ", rank 1, step 2: device memory")));
  EXPECT_THAT(text.out, HasSubstr(absl::StrCat(job_->id(), ", rank 1, step 2: host memory")));
  EXPECT_THAT(text.out, HasSubstr("forward 0"));
  EXPECT_THAT(text.out, HasSubstr("W weights (bound "));
  EXPECT_THAT(text.out, HasSubstr("O optimizer (bound "));
  Ran json = RunCommand({"client/plateauctl", "--coordinator=" + cluster_->api(), "--output=json", "memory",
                         job_->id()},
                        dir + "/ctl-memory-json");
  ASSERT_EQ(json.code, 0) << json.err;
  EXPECT_THAT(json.out, HasSubstr("\"ranks\":[{"));
  EXPECT_THAT(json.out, HasSubstr("\"name\":\"recompute 1\""));
  // --png: the same charts as a PNG file, one 1000 x 420 panel per space,
  // read back with zlib (not our encoder's own decoder).
  const std::string png = dir + "/memory-rank1.png";
  Ran wrote = RunCommand({"client/plateauctl", "--coordinator=" + cluster_->api(), "memory", job_->id(), "--rank=1",
                          "--png=" + png},
                         dir + "/ctl-memory-png");
  ASSERT_EQ(wrote.code, 0) << wrote.out << wrote.err;
  EXPECT_THAT(wrote.out, HasSubstr("2 panel(s): device, host"));
  auto img = DecodePng(ReadFile(png));
  ASSERT_TRUE(img.ok()) << img.status();
  EXPECT_EQ(img->width, 1000);
  EXPECT_EQ(img->height, 2 * 420);
  EXPECT_GT(CountNear(*img, 0x4e79a7, 0), 1000) << "the weights band";
  Ran bad = RunCommand({"client/plateauctl", "--coordinator=" + cluster_->api(), "memory", job_->id(), "--rank=7"},
                       dir + "/ctl-memory-bad");
  EXPECT_EQ(bad.code, 2);
  EXPECT_THAT(bad.err, AllOf(HasSubstr("INVALID_ARGUMENT"), HasSubstr("ranks with one: 0, 1")));
}

TEST_F(MemoryPageTest, ChromiumDrawsEveryLiveSetAndBound) {
  ASSERT_TRUE(std::filesystem::exists(kChromium))
      << kChromium << " is missing: deploy/install-deps.sh --tests installs Debian's chromium";
  auto t = cluster_->client().GetMemoryTimeline(job_->id());
  ASSERT_TRUE(t.ok()) << t.status();
  const std::string url = absl::StrCat("http://", cluster_->metrics(), "/jobs/", job_->id(), "/memory?rank=0");
  const std::string dir = cluster_->dir();

  Ran dom = Chromium(dir, "--dump-dom", url);
  ASSERT_EQ(dom.code, 0) << dom.err;
  EXPECT_THAT(dom.out, HasSubstr(absl::StrCat(job_->id(), " memory timeline, rank 0")));
  // Every live set the rank held at a phase end has its bands in the chart
  // of its space; every bound of the plan its line.
  const v1::MemoryTimeline& m = t->ranks(0);
  const size_t device_chart = dom.out.find("data-space=\"device\"");
  const size_t host_chart = dom.out.find("data-space=\"host\"");
  ASSERT_NE(device_chart, std::string::npos) << dom.out;
  ASSERT_NE(host_chart, std::string::npos) << dom.out;
  ASSERT_LT(device_chart, host_chart);
  const std::string device = dom.out.substr(device_chart, host_chart - device_chart);
  const std::string host = dom.out.substr(host_chart);
  std::set<std::string> held_device, held_host;
  for (const v1::MemoryTimelinePhase& p : m.phases()) {
    for (int i = 0; i < m.live_sets_size(); ++i) {
      if (p.device_bytes(i) > 0) held_device.insert(m.live_sets(i));
      if (p.host_bytes(i) > 0) held_host.insert(m.live_sets(i));
    }
  }
  EXPECT_GE(held_device.size(), 4u);
  EXPECT_GE(held_host.size(), 2u) << "SCO's boundaries and OffloadStreamAdamW's state";
  for (const std::string& s : held_device) {
    EXPECT_THAT(device, HasSubstr(absl::StrCat("class=\"band\" data-live-set=\"", s, "\""))) << s;
  }
  for (const std::string& s : held_host) {
    EXPECT_THAT(host, HasSubstr(absl::StrCat("class=\"band\" data-live-set=\"", s, "\""))) << s;
  }
  int bounds = 0;
  for (const v1::LiveSetBytes& b : t->plan().live_sets()) {
    if (b.bytes() == 0) continue;
    ++bounds;
    EXPECT_THAT(device, HasSubstr(absl::StrCat("class=\"bound\" data-live-set=\"", b.live_set(), "\" data-bytes=\"",
                                               b.bytes(), "\"")))
        << b.live_set();
  }
  for (const v1::LiveSetBytes& b : t->plan().host_live_sets()) {
    if (b.bytes() == 0) continue;
    ++bounds;
    EXPECT_THAT(host, HasSubstr(absl::StrCat("class=\"bound\" data-live-set=\"", b.live_set(), "\" data-bytes=\"",
                                             b.bytes(), "\"")))
        << b.live_set();
  }
  EXPECT_GE(bounds, 6);
  EXPECT_THAT(device, HasSubstr(absl::StrCat("class=\"cap\" data-bytes=\"", job_->spec().device_memory_bytes(), "\"")));
  EXPECT_THAT(device, HasSubstr("class=\"plan-total\""));

  const std::string png = dir + "/memory.png";
  Ran shot = Chromium(dir, "--screenshot=" + png, url);
  ASSERT_EQ(shot.code, 0) << shot.err;
  // Kept for a person to look at (bazel-testlogs/.../test.outputs).
  if (const char* out = std::getenv("TEST_UNDECLARED_OUTPUTS_DIR")) {
    std::error_code ec;
    std::filesystem::copy_file(png, std::string(out) + "/memory.png",
                               std::filesystem::copy_options::overwrite_existing, ec);
  }
  auto img = DecodePng(ReadFile(png));
  ASSERT_TRUE(img.ok()) << img.status();
  EXPECT_EQ(img->width, 1100);
  EXPECT_EQ(img->height, 1400);
  std::set<uint32_t> colours(img->pixels.begin(), img->pixels.end());
  EXPECT_GT(colours.size(), 8u) << "a blank screenshot";
  // The weights band (#4e79a7) is a solid area, not a stray pixel.
  EXPECT_GT(CountNear(*img, 0x4e79a7, 3), 1000) << colours.size() << " colours";
}

}  // namespace
}  // namespace plateau
