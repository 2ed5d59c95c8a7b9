// Test certificates, made by openssl (deploy/install-deps.sh installs it)
// as PEM files under a test's directory: the coordinator's own (self-signed,
// its own CA), and clients' certificates that a CA signed, for mutual TLS.
#ifndef PLATEAU_TESTS_CERTIFICATES_H_
#define PLATEAU_TESTS_CERTIFICATES_H_

#include <string>

#include "tests/cluster.h"

namespace plateau {
namespace testing_certificates {

struct Pem {
  std::string cert;  // dir/name.crt
  std::string key;   // dir/name.key
};

// A self-signed certificate (CA:TRUE, so it can sign others) for the
// subjectAltName `san` ("IP:127.0.0.1,DNS:localhost"). False, with the
// failure reported to GoogleTest, when openssl fails.
bool MakeSelfSigned(const std::string& dir, const std::string& name, const std::string& san, Pem* out);

// A client certificate (extendedKeyUsage clientAuth, CN=`name`) that `ca`
// signed, each with a serial of its own (ca.cert + ".srl" counts them).
// With `san` ("DNS:robot.example"), the certificate has no common name,
// only that subject alternative name.
bool MakeSignedBy(const Pem& ca, const std::string& dir, const std::string& name, Pem* out,
                  const std::string& san = "");

// The files of mutual TLS: the coordinator's certificate (self-signed for
// `server_san`), a CA of clients, and one client's certificate it signed
// (CN=`client_name`).
struct MutualTls {
  Pem server, client_ca, client;
};
bool MakeMutualTls(const std::string& dir, const std::string& server_san, const std::string& client_name,
                   MutualTls* out);

// A test cluster on them: the coordinator serves `m.server` and requires
// certificates of `m.client_ca`; the worker (and its ranks) and the test's
// client present `m.client`.
void UseMutualTls(const MutualTls& m, testing_cluster::ClusterOptions* o);

}  // namespace testing_certificates
}  // namespace plateau

#endif  // PLATEAU_TESTS_CERTIFICATES_H_
