// What farmemctl.cc (main, option parsing, demo, drain, key issue) and farmemctl_stat.cc (stat,
// export stat) share: the cluster options every command takes, connecting with them, the
// per-daemon usage table and the stat commands' entry points.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>

#include "farmem/client/cluster.h"
#include "farmem/common/status.h"

namespace farmem::ctl {

struct Common {
  std::string peers, peers_dns, secret_file, key_file, transport = "auto";
};

// client_id: the id to present (a restarted `kmod attach` renewing its predecessor's leases);
// unset: a random one.
Result<std::unique_ptr<client::Cluster>> ConnectCluster(
    const Common& c, const char* name,
    const std::optional<wire::ClientId>& client_id = std::nullopt);

// Per-daemon state and usage as a table; with `written` (demo), also what this client wrote.
void PrintNodes(client::Cluster& cluster, const std::map<client::NodeId, uint64_t>& written);

// `farmemctl stat` and `farmemctl export stat`; they return the exit code.
int StatCmd(const Common& c, bool json);
int ExportStatCmd(const std::string& target, bool json);

// `farmemctl kmod attach` and `farmemctl kmod detach` (farmemctl_kmod.cc, docs/kmod.md).
int KmodAttachCmd(const Common& c, const std::string& size, const std::string& resilience,
                  const std::string& sysfs_dir);
int KmodDetachCmd(const std::string& sysfs_dir);

}  // namespace farmem::ctl
