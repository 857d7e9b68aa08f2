// AuthPolicy: whom farmemd admits — the cluster secret, the secrets of a rotation window, and the
// revoked identities — read from the files the operator names (--secret-file, --old-secret-file,
// --revoked-file) at start and again on SIGHUP (docs/operations.md, "Security").
//
// Threading: LoadAuthPolicy is pure file reading; any thread may call it.
#pragma once

#include <functional>
#include <set>
#include <string>
#include <vector>

#include "farmem/common/status.h"

namespace farmem::daemon {

struct AuthPolicy {
  std::string secret;                          // the cluster secret; empty: no authentication
  std::vector<std::string> old_secrets;        // also accepted (key rotation)
  std::set<std::string, std::less<>> revoked;  // identities refused at HELLO
};

struct AuthFiles {
  std::string secret_file;
  std::string old_secret_file;
  std::string revoked_file;
};

// Reads every file named. At start (`reload` false) a missing file is an error; on a reload a
// missing --old-secret-file closes the rotation window (the operator removed it), anything else
// missing or invalid is an error and the caller keeps the policy it has.
Result<AuthPolicy> LoadAuthPolicy(const AuthFiles& files, bool reload);

// The revoked-file format: one identity per line; blank lines and lines starting with '#' are
// ignored. A line that is not a valid identity name is an error naming the line.
Result<std::set<std::string, std::less<>>> ParseRevokedList(const std::string& text,
                                                            const std::string& path);

}  // namespace farmem::daemon
