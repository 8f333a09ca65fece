#include "daemon/security/certificate_check.h"

#include <openssl/bio.h>
#include <openssl/err.h>
#include <openssl/pem.h>
#include <openssl/x509.h>
#include <openssl/x509_vfy.h>
#include <openssl/x509v3.h>

#include <fstream>
#include <memory>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace refit {
namespace {

// RAII owners of OpenSSL's objects.
struct BioFree {
  void operator()(BIO* b) const { BIO_free(b); }
};
struct X509Free {
  void operator()(X509* x) const { X509_free(x); }
};
struct KeyFree {
  void operator()(EVP_PKEY* k) const { EVP_PKEY_free(k); }
};
struct StoreFree {
  void operator()(X509_STORE* s) const { X509_STORE_free(s); }
};
struct StoreCtxFree {
  void operator()(X509_STORE_CTX* c) const { X509_STORE_CTX_free(c); }
};
struct StackFree {
  void operator()(STACK_OF(X509) * s) const { sk_X509_pop_free(s, X509_free); }
};
struct NamesFree {
  void operator()(GENERAL_NAMES* n) const { GENERAL_NAMES_free(n); }
};
using Bio = std::unique_ptr<BIO, BioFree>;
using Cert = std::unique_ptr<X509, X509Free>;

absl::StatusOr<std::string> Read(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot read ", path));
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

// Every certificate in a PEM text, in order.
std::vector<Cert> Certificates(const std::string& pem) {
  std::vector<Cert> out;
  Bio bio(BIO_new_mem_buf(pem.data(), static_cast<int>(pem.size())));
  if (bio == nullptr) return out;
  while (X509* x = PEM_read_bio_X509(bio.get(), nullptr, nullptr, nullptr)) out.emplace_back(x);
  ERR_clear_error();  // the read past the last one
  return out;
}

std::vector<std::string> NamesOf(X509* cert) {
  std::vector<std::string> names;
  char cn[256];
  const int n =
      X509_NAME_get_text_by_NID(X509_get_subject_name(cert), NID_commonName, cn, sizeof cn);
  if (n > 0) names.emplace_back(cn, static_cast<size_t>(n));
  std::unique_ptr<GENERAL_NAMES, NamesFree> sans(
      static_cast<GENERAL_NAMES*>(X509_get_ext_d2i(cert, NID_subject_alt_name, nullptr, nullptr)));
  for (int i = 0; sans != nullptr && i < sk_GENERAL_NAME_num(sans.get()); ++i) {
    const GENERAL_NAME* g = sk_GENERAL_NAME_value(sans.get(), i);
    if (g->type != GEN_DNS) continue;
    const ASN1_IA5STRING* dns = g->d.dNSName;
    names.emplace_back(reinterpret_cast<const char*>(ASN1_STRING_get0_data(dns)),
                       static_cast<size_t>(ASN1_STRING_length(dns)));
  }
  return names;
}

std::string Listed(const std::vector<std::string>& names) {
  return names.empty() ? "none" : absl::StrJoin(names, ", ");
}

}  // namespace

absl::StatusOr<std::vector<std::string>> CertificateNames(const std::string& pem) {
  std::vector<Cert> certs = Certificates(pem);
  if (certs.empty()) return absl::InvalidArgumentError("no PEM certificate in it");
  return NamesOf(certs.front().get());
}

absl::Status CheckDaemonCertificate(const TlsConfig& tls, int32_t node) {
  auto bad = [](const std::string& what) { return absl::InvalidArgumentError(what); };
  absl::StatusOr<std::string> cert_pem = Read(tls.cert), key_pem = Read(tls.key),
                              ca_pem = Read(tls.ca);
  for (const auto* s : {&cert_pem, &key_pem, &ca_pem}) {
    if (!s->ok()) return bad(std::string(s->status().message()));
  }
  std::vector<Cert> chain = Certificates(*cert_pem);
  if (chain.empty())
    return bad(absl::StrCat("--tls-cert ", tls.cert, ": no PEM certificate in it"));
  X509* leaf = chain.front().get();
  Bio key_bio(BIO_new_mem_buf(key_pem->data(), static_cast<int>(key_pem->size())));
  std::unique_ptr<EVP_PKEY, KeyFree> key(
      PEM_read_bio_PrivateKey(key_bio.get(), nullptr, nullptr, nullptr));
  if (key == nullptr) {
    ERR_clear_error();
    return bad(absl::StrCat("--tls-key ", tls.key,
                            ": no PEM private key in it (or one with a passphrase)"));
  }
  if (X509_check_private_key(leaf, key.get()) != 1) {
    ERR_clear_error();
    return bad(absl::StrCat("--tls-key ", tls.key, " is not the key of --tls-cert ", tls.cert));
  }
  const std::vector<std::string> names = NamesOf(leaf);
  const std::string node_name = absl::StrCat(kNodeIdentityPrefix, node);
  if (NodeOfNames(names) != node) {
    return bad(absl::StrCat("--tls-cert ", tls.cert, " is not node ", node,
                            "'s: a daemon's certificate names ", node_name,
                            " (CN or DNS SAN) and no other node (its names: ", Listed(names), ")"));
  }
  if (std::find(names.begin(), names.end(), kTlsServerName) == names.end()) {
    return bad(absl::StrCat("--tls-cert ", tls.cert, " lacks the DNS name ", kTlsServerName,
                            ", which every daemon and client checks when it connects (its names: ",
                            Listed(names), "); tools/gen_certs.sh makes both"));
  }
  std::vector<Cert> cas = Certificates(*ca_pem);
  if (cas.empty()) return bad(absl::StrCat("--tls-ca ", tls.ca, ": no PEM certificate in it"));
  std::unique_ptr<X509_STORE, StoreFree> store(X509_STORE_new());
  for (const Cert& ca : cas) X509_STORE_add_cert(store.get(), ca.get());
  std::unique_ptr<STACK_OF(X509), StackFree> untrusted(sk_X509_new_null());
  for (size_t i = 1; i < chain.size(); ++i) {
    X509_up_ref(chain[i].get());
    sk_X509_push(untrusted.get(), chain[i].get());
  }
  std::unique_ptr<X509_STORE_CTX, StoreCtxFree> ctx(X509_STORE_CTX_new());
  if (ctx == nullptr || X509_STORE_CTX_init(ctx.get(), store.get(), leaf, untrusted.get()) != 1) {
    return absl::InternalError("OpenSSL could not set up a certificate check");
  }
  if (X509_verify_cert(ctx.get()) != 1) {
    const int err = X509_STORE_CTX_get_error(ctx.get());
    ERR_clear_error();
    return bad(absl::StrCat("--tls-cert ", tls.cert, " does not verify against --tls-ca ", tls.ca,
                            ": ", X509_verify_cert_error_string(err)));
  }
  return absl::OkStatus();
}

}  // namespace refit
