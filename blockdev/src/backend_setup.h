// farmem-nbd's backends (main.cc wires the command line to them): the flags of each backend,
// the checks that reject flags which do not apply, opening the chosen one, and the export's
// metrics. To add a backend: give it a name in BackendConfig::kind's check, add its flags (for the
// remote page store: --peers, --resilience, ...) in AddBackendFlags and to CheckFlagsApply's list
// (a flag that does not apply to the chosen backend is an error), and open it in OpenBackend.
// Used by main() only, on the main thread.
#pragma once

#include <CLI/CLI.hpp>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>

#include "farmem/blockdev/block_backend.h"
#include "farmem/client/cluster.h"
#include "farmem/common/metrics.h"
#include "farmem/common/status.h"
#include "page_store.h"  // Resilience

namespace farmem::blockdev {

struct BackendConfig {
  std::string kind = "memory";
  std::string size = "1G";
  // --backend farmem: the remote page store on farmemd daemons.
  std::string peers, peers_dns, secret_file, key_file, resilience = "ec:4+2", backup,
                                                       transport = "auto";
  // ec:k+r only, how pages are laid out: "stripe" (whole pages in stripes of k pages + r parity,
  // StripeStore; the default) or "split" (each page cut into k fragments, PageStore, Hydra's;
  // also spelled --resilience ec-split:k+r). docs/nbd.md "Stripe layout". Before ResolveLayout:
  // --ec-layout as given (empty: not given); after it: the layout that serves the export (empty
  // for none and replicate), and `resilience` as ec:k+r.
  std::string ec_layout;
  // Stripe layout only: the daemons move the cells compaction moves (StripeStoreOptions).
  bool compaction_offload = false;
  // Stripe layout only: the next slab group is leased before writes need it (StripeStoreOptions;
  // --no-lease-ahead turns it off).
  bool lease_ahead = true;
  uint32_t heartbeat_ms = 500, failure_timeout_ms = 2000, peer_wait_ms = 5000;
  // The write-back page cache in front of the page store (write_cache.h, docs/nbd.md).
  uint32_t write_cache_pages = 256, write_cache_max_age_ms = 100;
  // How long a request waiting on one daemon spins before it sleeps (client::ChannelSet).
  uint32_t busy_poll_us = 0;
  bool overcommit = false;
  // Page encryption (docs/security.md): on unless --no-encrypt; the key from --data-key-file
  // (created if absent) or a fresh one per start.
  bool encrypt = true;
  std::string data_key_file;
  std::unique_ptr<farmem::client::Cluster> cluster;  // outlives the page store (declared first)
};

void AddBackendFlags(CLI::App& app, BackendConfig* cfg);
// Flags of the farmem backend given with another backend are an error (see the definition).
Status CheckFlagsApply(const CLI::App& app, const BackendConfig& cfg);
// Encryption flags that contradict each other fail closed.
Status CheckEncryptionFlags(const BackendConfig& cfg);
// --resilience as farmem-nbd takes it: the page store's (Resilience::Parse) plus the spelling
// "ec-split:k+r", ec:k+r in the split layout (the same as ec:k+r --ec-layout split).
struct ExportResilience {
  Resilience resilience;
  bool split_spelled = false;  // written ec-split:k+r
};
Result<ExportResilience> ParseExportResilience(std::string_view text);
// Settles the layout of an ec:k+r export (the stripe layout unless --ec-layout split or
// ec-split:k+r) into cfg->ec_layout, and cfg->resilience to its ec:k+r spelling. Fails closed on
// layout options that contradict each other or do not apply: --ec-layout with none / replicate,
// ec-split:k+r with --ec-layout stripe, --compaction-offload with anything but the stripe
// layout, a k + r the chosen layout cannot serve. Idempotent; OpenBackend calls it too.
Status ResolveLayout(BackendConfig* cfg);
// "ec:4+2, stripe layout" / "replicate:2" / "" (memory backend): for the log and status lines.
std::string DescribeProtection(const BackendConfig& cfg);
// Opens the backend cfg names (for farmem: connects cfg.cluster, then the page store).
Result<std::unique_ptr<BlockBackend>> OpenBackend(BackendConfig& cfg);
// The export's health for --metrics-listen (docs/operations.md "Metrics").
void RegisterExportMetrics(metrics::Registry* r, BackendConfig* cfg, BlockBackend* backend,
                           const std::string& export_name);

}  // namespace farmem::blockdev
