#include "tests/certificates.h"

#include <fstream>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "tests/cluster.h"

namespace plateau {
namespace testing_certificates {
namespace {

constexpr char kOpenssl[] = "/usr/bin/openssl";

bool Ok(const testing_cluster::Ran& r, const std::string& what) {
  EXPECT_EQ(r.code, 0) << "openssl " << what << " (deploy/install-deps.sh installs it): " << r.err;
  return r.code == 0;
}

}  // namespace

bool MakeSelfSigned(const std::string& dir, const std::string& name, const std::string& san, Pem* out) {
  out->cert = absl::StrCat(dir, "/", name, ".crt");
  out->key = absl::StrCat(dir, "/", name, ".key");
  return Ok(testing_cluster::RunCommand(
                {kOpenssl, "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
                 "-keyout", out->key, "-out", out->cert, "-days", "2", "-subj", "/CN=plateau-test-" + name, "-addext",
                 "subjectAltName=" + san},
                absl::StrCat(dir, "/openssl-", name)),
            "req -x509 " + name);
}

bool MakeSignedBy(const Pem& ca, const std::string& dir, const std::string& name, Pem* out, const std::string& san) {
  out->cert = absl::StrCat(dir, "/", name, ".crt");
  out->key = absl::StrCat(dir, "/", name, ".key");
  const std::string csr = absl::StrCat(dir, "/", name, ".csr");
  const std::string ext = absl::StrCat(dir, "/", name, ".ext");
  std::ofstream(ext) << "basicConstraints=CA:FALSE\nkeyUsage=digitalSignature\nextendedKeyUsage=clientAuth\n"
                     << (san.empty() ? "" : "subjectAltName=" + san + "\n");
  return Ok(testing_cluster::RunCommand(
                {kOpenssl, "req", "-new", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
                 "-keyout", out->key, "-out", csr, "-subj", san.empty() ? "/CN=" + name : "/O=plateau-test"},
                absl::StrCat(dir, "/openssl-req-", name)),
            "req -new " + name) &&
         Ok(testing_cluster::RunCommand(
                {kOpenssl, "x509", "-req", "-in", csr, "-CA", ca.cert, "-CAkey", ca.key, "-CAserial", ca.cert + ".srl",
                 "-CAcreateserial", "-days", "2", "-extfile", ext, "-out", out->cert},
                absl::StrCat(dir, "/openssl-x509-", name)),
            "x509 -req " + name);
}

bool MakeMutualTls(const std::string& dir, const std::string& server_san, const std::string& client_name,
                   MutualTls* out) {
  return MakeSelfSigned(dir, "coordinator", server_san, &out->server) &&
         MakeSelfSigned(dir, "clients-ca", "DNS:clients-ca.plateau.test", &out->client_ca) &&
         MakeSignedBy(out->client_ca, dir, client_name, &out->client);
}

void UseMutualTls(const MutualTls& m, testing_cluster::ClusterOptions* o) {
  o->coordinator_flags.insert(o->coordinator_flags.end(),
                              {"--tls_cert_file=" + m.server.cert, "--tls_key_file=" + m.server.key,
                               "--tls_client_ca_file=" + m.client_ca.cert});
  o->worker_flags.insert(o->worker_flags.end(),
                         {"--tls_ca_file=" + m.server.cert, "--tls_client_cert_file=" + m.client.cert,
                          "--tls_client_key_file=" + m.client.key});
  o->client.connection.files.tls_ca_file = m.server.cert;
  o->client.connection.files.tls_client_cert_file = m.client.cert;
  o->client.connection.files.tls_client_key_file = m.client.key;
}

}  // namespace testing_certificates
}  // namespace plateau
