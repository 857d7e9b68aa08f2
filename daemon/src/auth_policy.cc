#include "auth_policy.h"

#include <fmt/format.h>
#include <spdlog/spdlog.h>
#include <sys/stat.h>

#include <fstream>
#include <sstream>

#include "farmem/common/auth.h"

namespace farmem::daemon {

Result<std::set<std::string, std::less<>>> ParseRevokedList(const std::string& text,
                                                            const std::string& path) {
  std::set<std::string, std::less<>> out;
  std::istringstream in(text);
  std::string line;
  int n = 0;
  while (std::getline(in, line)) {
    ++n;
    const size_t b = line.find_first_not_of(" \t\r");
    const size_t e = line.find_last_not_of(" \t\r");
    if (b == std::string::npos || line[b] == '#') continue;
    std::string name = line.substr(b, e - b + 1);
    if (Status s = auth::ValidateIdentity(name); !s.ok()) {
      return Err(InvalidArgument(fmt::format("{} line {}: {}", path, n, s.message())));
    }
    out.insert(std::move(name));
  }
  return out;
}

Result<AuthPolicy> LoadAuthPolicy(const AuthFiles& files, bool reload) {
  AuthPolicy p;
  if (!files.secret_file.empty()) {
    auto secret = auth::LoadSecretFile(files.secret_file);
    if (!secret) return Err(secret.error().WithContext("--secret-file"));
    p.secret = std::move(*secret);
  }
  if (!files.old_secret_file.empty()) {
    struct stat st {};
    if (reload && ::stat(files.old_secret_file.c_str(), &st) != 0 && errno == ENOENT) {
      spdlog::info("--old-secret-file {} is gone: the old secret is no longer accepted",
                   files.old_secret_file);
    } else {
      auto old = auth::LoadSecretFile(files.old_secret_file);
      if (!old) return Err(old.error().WithContext("--old-secret-file"));
      if (*old != p.secret) p.old_secrets.push_back(std::move(*old));
    }
  }
  if (!files.revoked_file.empty()) {
    std::ifstream in(files.revoked_file);
    if (!in) {
      return Err(ErrnoStatus(StatusCode::kNotFound,
                             fmt::format("--revoked-file {}", files.revoked_file), errno));
    }
    std::ostringstream ss;
    ss << in.rdbuf();
    FARMEM_ASSIGN_OR_RETURN(p.revoked, ParseRevokedList(ss.str(), files.revoked_file));
  }
  return p;
}

}  // namespace farmem::daemon
