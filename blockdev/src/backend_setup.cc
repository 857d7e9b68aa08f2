// farmem-nbd's backends (backend_setup.h): flags, checks, opening, the export's metrics.
#include "backend_setup.h"

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <charconv>
#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <thread>

#include "export_capacity.h"
#include "farmem/blockdev/block_backend.h"
#include "farmem/blockdev/write_cache.h"
#include "farmem/client/channel_set.h"
#include "farmem/client/cluster.h"
#include "farmem/common/aead.h"
#include "farmem/common/auth.h"
#include "farmem/common/command_line.h"
#include "farmem/common/config.h"
#include "farmem/common/metrics.h"
#include "farmem/common/status.h"
#include "farmem/common/version.h"
#include "page_store.h"
#include "stripe_store.h"

namespace farmem::blockdev {

void AddBackendFlags(CLI::App& app, BackendConfig* cfg) {
  app.add_option("--backend", cfg->kind,
                 "Where the device's bytes live. 'memory': this process's RAM, allocated (and "
                 "with --swap-safe locked) up front; for tests and benchmarks.")
      ->check(farmem::cli::OneOf({"memory", "farmem"}))
      ->capture_default_str();
  app.add_option("--size", cfg->size,
                 "Device size, e.g. 1G, 512M, 1073741824 (a multiple of 512 bytes; 4096 for "
                 "farmem).")
      ->capture_default_str();
  app.add_option("--peers", cfg->peers,
                 "farmem: the daemons, host:port,host:port (port defaults to 7411)");
  app.add_option("--peers-dns", cfg->peers_dns,
                 "farmem: a name:port whose every address is a "
                 "daemon");
  app.add_option("--secret-file", cfg->secret_file,
                 "farmem: the cluster secret (authenticates as the administrator identity "
                 "'cluster'; prefer --key-file)");
  app.add_option("--key-file", cfg->key_file,
                 "farmem: the key file of this client's identity (farmemctl key issue); its "
                 "leases are bound to that name");
  app.add_option("--resilience", cfg->resilience,
                 "farmem: none, replicate:N or ec:k+r (Reed-Solomon over k+r daemons, any k of "
                 "which hold the data; --ec-layout says how pages are laid out); ec-split:k+r is "
                 "ec:k+r --ec-layout split")
      ->capture_default_str()
      ->check(CLI::Validator(
          [](std::string& text) -> std::string {
            auto r = farmem::blockdev::ParseExportResilience(text);
            return r ? std::string() : r.error().message();
          },
          "none|replicate:N|ec:K+R|ec-split:K+R"));
  app.add_option("--ec-layout", cfg->ec_layout,
                 "farmem, ec:k+r only: 'stripe' (the default) keeps each 4 KiB page whole on one "
                 "daemon in stripes of k pages + r parity pages (a read is one message to one "
                 "daemon; overwrites leave holes that compaction reclaims); 'split' (Hydra's) "
                 "cuts each page into k fragments on k+r daemons (a read asks all of them)")
      ->check(farmem::cli::OneOf({"split", "stripe"}));
  app.add_flag("--compaction-offload", cfg->compaction_offload,
               "farmem, stripe layout only: the daemons copy the cells compaction moves and "
               "compute the new stripes' parity themselves (~40x fewer client bytes; at 4 KiB "
               "cells more client CPU per page and slower passes: docs/nbd.md). The daemons must "
               "reach each other at the addresses the client knows them by");
  app.add_flag("!--no-lease-ahead", cfg->lease_ahead,
               "farmem, stripe layout only: do not lease the next slab group (k+r slabs) in the "
               "background once the groups in use are half full; a write that finds no free row "
               "then waits for k+r ALLOCs. For comparisons, or lenders that must hold no slab "
               "before it is written (docs/nbd.md)");
  app.add_option("--backup", cfg->backup,
                 "farmem: also write every block to this local file (io_uring); reads fall back "
                 "to it when remote copies are gone");
  app.add_option("--transport", cfg->transport, "farmem: tcp, verbs or auto")
      ->capture_default_str()
      ->check(farmem::cli::OneOf(farmem::kTransports));
  app.add_option("--heartbeat-ms", cfg->heartbeat_ms, "farmem: heartbeat period")
      ->capture_default_str();
  app.add_option("--failure-timeout-ms", cfg->failure_timeout_ms,
                 "farmem: a daemon silent this long is declared down and its data rebuilt")
      ->capture_default_str();
  app.add_flag("--overcommit", cfg->overcommit,
               "farmem: start even when --size at this --resilience needs more memory than the "
               "daemons have free (writes beyond it then fail with ENOSPC); without it such an "
               "export is refused at start");
  app.add_flag("--encrypt,!--no-encrypt", cfg->encrypt,
               "farmem: seal every page with AES-256-GCM before it leaves this process (the "
               "daemons, parity and --backup hold only ciphertext) and authenticate it on the way "
               "back. On by default; --no-encrypt (benchmarks only) stores plaintext on the "
               "lenders and says so in the log");
  app.add_option("--data-key-file", cfg->data_key_file,
                 "farmem: the export's data key: loaded if the file exists, else created there "
                 "(mode 600) with a new key. Without it a new key is drawn at every start and "
                 "never leaves this process");
  app.add_option("--peer-wait-ms", cfg->peer_wait_ms,
                 "farmem: at start, wait up to this long for the first daemon to answer (then "
                 "fail), and for every peer to answer before checking that the export fits")
      ->capture_default_str()
      ->check(CLI::Range(0u, 600u * 1000u));
  app.add_option(
         "--write-cache-pages", cfg->write_cache_pages,
         "farmem: 4 KiB pages of the write-back cache that absorbs writes smaller than a "
         "page (no read-modify-write per request) and small whole-page writes (under 64 KiB; "
         "stripe layout: 4k pages); written back on FLUSH, FUA, after "
         "--write-cache-max-age-ms and when full. 0 turns it off")
      ->capture_default_str()
      ->check(CLI::Validator(
          [](std::string& text) -> std::string {
            // Validators see the text before CLI11 converts it: all of it must be the number.
            unsigned long long n = 0;
            const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), n);
            if (ec != std::errc() || end != text.data() + text.size()) {
              return fmt::format("'{}' is not a number of pages", text);
            }
            if (n == 0 || (n >= farmem::blockdev::WriteCache::kMinPages && n <= (1ull << 24))) {
              return std::string();
            }
            return fmt::format("{} pages: give 0 (no cache) or {} to {}", text,
                               farmem::blockdev::WriteCache::kMinPages, 1ull << 24);
          },
          "0|8..16777216"));
  app.add_option("--write-cache-max-age-ms", cfg->write_cache_max_age_ms,
                 "farmem: a page of the write cache goes back to the page store at the latest "
                 "this long after it was first written")
      ->capture_default_str()
      ->check(CLI::Range(1u, 60u * 1000u));
  app.add_option("--busy-poll-us", cfg->busy_poll_us,
                 "farmem: a request waiting for one daemon's reply spins (yielding the CPU to "
                 "anything runnable) up to this many microseconds before it sleeps: saves the "
                 "wake-up at queue depth 1 at the cost of CPU. 0 never spins")
      ->capture_default_str()
      ->check(
          CLI::Range(0u, static_cast<uint32_t>(farmem::client::ChannelSet::kMaxBusyPoll.count())));
}

// The flags of --backend farmem: given with another backend they would be ignored (a --peers
// that silently serves from local RAM), so they are an error there.
Status CheckFlagsApply(const CLI::App& app, const BackendConfig& cfg) {
  if (cfg.kind == "farmem") {
    if (cfg.write_cache_pages != 0) return Status::Ok();
    return farmem::cli::RejectGiven(
        app, {"--write-cache-max-age-ms"},
        "only to the write cache, and --write-cache-pages 0 turns it off: give the cache pages, "
        "or leave it out");
  }
  return farmem::cli::RejectGiven(
      app,
      {"--peers", "--peers-dns", "--secret-file", "--key-file", "--resilience", "--ec-layout",
       "--backup", "--transport", "--heartbeat-ms", "--failure-timeout-ms", "--overcommit",
       "--peer-wait-ms", "--encrypt", "--data-key-file", "--write-cache-pages",
       "--write-cache-max-age-ms", "--busy-poll-us", "--compaction-offload", "--no-lease-ahead"},
      "only to --backend farmem, and this is --backend " + cfg.kind +
          " (the device lives in this process's RAM): add --backend farmem, or leave "
          "them out");
}

// Encryption options that contradict each other fail closed: a key file given with --no-encrypt
// would suggest the data is protected by it when it is stored in plaintext. So does a
// FARMEM_AEAD_IMPL that names no implementation (its message lists the accepted values).
Status CheckEncryptionFlags(const BackendConfig& cfg) {
  if (cfg.kind == "farmem" && cfg.encrypt) {
    if (auto impl = farmem::aead::ChosenImpl(); !impl) return impl.error();
  }
  if (cfg.kind != "farmem" || cfg.encrypt) return Status::Ok();
  if (!cfg.data_key_file.empty()) {
    return farmem::InvalidArgument(
        "--data-key-file applies only with encryption, and --no-encrypt turns it off: leave out "
        "--no-encrypt (pages are then encrypted with the key in that file) or --data-key-file");
  }
  return Status::Ok();
}

Result<ExportResilience> ParseExportResilience(std::string_view text) {
  constexpr std::string_view kSplit = "ec-split:";
  ExportResilience out;
  if (text.starts_with(kSplit)) {
    out.split_spelled = true;
    const std::string ec = "ec:" + std::string(text.substr(kSplit.size()));
    auto r = Resilience::Parse(ec);
    if (!r) {
      return farmem::Err(farmem::InvalidArgument(
          fmt::format("'{}' (ec:k+r in the split layout): {}", text, r.error().message())));
    }
    out.resilience = *r;
    return out;
  }
  FARMEM_ASSIGN_OR_RETURN(out.resilience, Resilience::Parse(text));
  return out;
}

namespace {
// The first option given that only the stripe layout takes, or null.
const char* StripeOnlyFlag(const BackendConfig& cfg) {
  if (cfg.compaction_offload) return "--compaction-offload";
  if (!cfg.lease_ahead) return "--no-lease-ahead";
  return nullptr;
}
}  // namespace

Status ResolveLayout(BackendConfig* cfg) {
  if (cfg->kind != "farmem") return Status::Ok();
  auto parsed = ParseExportResilience(cfg->resilience);
  if (!parsed) return parsed.error().WithContext("--resilience");
  const Resilience& res = parsed->resilience;
  const std::string& given = cfg->ec_layout;
  if (res.mode != Resilience::Mode::kErasure) {
    if (!given.empty()) {
      return farmem::InvalidArgument(
          "--ec-layout " + given +
          " applies only to an ec:k+r --resilience, and this is --resilience " + cfg->resilience +
          " (none and replicate keep whole pages: there is no layout to choose): give "
          "--resilience ec:k+r, or leave out --ec-layout");
    }
    if (const char* flag = StripeOnlyFlag(*cfg)) {
      return farmem::InvalidArgument(
          fmt::format("{} applies only to the stripe layout of an ec:k+r --resilience, and this is "
                      "--resilience {}: give --resilience ec:k+r, or leave out {}",
                      flag, cfg->resilience, flag));
    }
    return Status::Ok();
  }
  const std::string ec = res.ToString();
  if (parsed->split_spelled && given == "stripe") {
    return farmem::InvalidArgument(fmt::format(
        "--resilience {} asks for the split layout and --ec-layout stripe for the stripe layout: "
        "give --resilience {} (the stripe layout is its default), or leave out --ec-layout",
        cfg->resilience, ec));
  }
  const std::string layout = parsed->split_spelled ? "split" : given.empty() ? "stripe" : given;
  // How the user chose it, for the messages below.
  const std::string chosen = parsed->split_spelled ? "--resilience " + cfg->resilience
                             : given.empty()       ? "the default for ec:k+r"
                                                   : "--ec-layout " + given;
  if (layout == "split") {
    if (const char* flag = StripeOnlyFlag(*cfg)) {
      return farmem::InvalidArgument(fmt::format(
          "{} applies only to the stripe layout (the split layout places each extent's slabs "
          "when it is first written, and does not compact), and {} chose the split layout: "
          "leave out {}, or give --resilience {} without --ec-layout split (the stripe layout)",
          flag, chosen, flag, ec));
    }
  } else if (Status s = StripeStore::CheckResilience(res); !s.ok()) {
    return s.WithContext("--resilience " + ec + " in the stripe layout (" + chosen + ")");
  }
  cfg->resilience = ec;
  cfg->ec_layout = layout;
  return Status::Ok();
}

std::string DescribeProtection(const BackendConfig& cfg) {
  if (cfg.kind != "farmem") return std::string();
  if (cfg.ec_layout.empty()) return cfg.resilience;
  return cfg.resilience + ", " + cfg.ec_layout + " layout";
}

namespace {

// Refuses an export the cluster cannot hold at its resilience, unless --overcommit; warns when
// it fits only once down daemons return.
Status CheckExportFits(farmem::client::Cluster& cluster, const BackendConfig& cfg, uint64_t size,
                       const farmem::blockdev::Resilience& resilience,
                       std::chrono::milliseconds peer_wait) {
  using Verdict = farmem::blockdev::ExportCapacity::Verdict;
  if (static_cast<size_t>(resilience.group_size()) > cluster.node_count()) {
    return Status::Ok();  // PageStore::Create says why this cannot work at all
  }
  FARMEM_ASSIGN_OR_RETURN(
      auto c, farmem::blockdev::SurveyExportCapacity(cluster, size, resilience, peer_wait));
  switch (c.verdict) {
    case Verdict::kFits:
      spdlog::info("farmem-nbd: {}: it fits", c.Describe());
      return Status::Ok();
    case Verdict::kFitsIfPeersReturn:
      spdlog::warn(
          "farmem-nbd: {}. It fits only once the {} down daemon(s) are back; until then writes "
          "beyond {} of the export may fail with ENOSPC",
          c.Describe(), c.daemons_down, farmem::FormatSize(c.largest_fitting));
      return Status::Ok();
    case Verdict::kTooBig:
      if (cfg.overcommit) {
        spdlog::warn(
            "farmem-nbd: --overcommit: {}. Writes beyond about {} of the export will fail with "
            "ENOSPC until daemons are added or memory is freed",
            c.Describe(), farmem::FormatSize(c.largest_fitting));
        return Status::Ok();
      }
      // As the user would type it: whole MiB when it is (slabs are), else bytes.
      const std::string fitting = c.largest_fitting % (1 << 20) == 0
                                      ? fmt::format("{}M", c.largest_fitting >> 20)
                                      : std::to_string(c.largest_fitting);
      return farmem::ResourceExhausted(fmt::format(
          "the export does not fit in the cluster: {}. Give --size {} or less, add daemons or "
          "memory, choose a cheaper --resilience, or pass --overcommit to start anyway (writes "
          "beyond the free memory then fail with ENOSPC)",
          c.Describe(), fitting));
  }
  return Status::Ok();
}

// Connects to the cluster, waiting up to --peer-wait-ms for the first daemon to answer: started
// at boot (systemd) farmem-nbd may come up before the lenders. Only "nobody answers yet" is
// waited out; a wrong secret or bad options fail at once.
Result<std::unique_ptr<farmem::client::Cluster>> ConnectCluster(
    const farmem::client::ClusterOptions& co, const BackendConfig& cfg, farmem::Deadline deadline) {
  // Between attempts: as often as the cluster retries a down daemon.
  const auto retry = std::max(std::chrono::milliseconds(100), co.heartbeat_interval * 2);
  const std::string what =
      co.peers_dns.empty()
          ? "--peers " + cfg.peers
          : (cfg.peers.empty() ? "--peers-dns " + co.peers_dns
                               : "--peers " + cfg.peers + " or --peers-dns " + co.peers_dns);
  bool logged = false;
  for (;;) {
    auto cluster = farmem::client::Cluster::Connect(co);
    if (cluster) {
      if (logged) spdlog::info("farmem-nbd: a daemon answered; going on");
      return cluster;
    }
    const farmem::StatusCode code = cluster.error().code();
    if (code != farmem::StatusCode::kUnavailable && code != farmem::StatusCode::kDeadlineExceeded) {
      return cluster;
    }
    const auto left =
        std::chrono::duration_cast<std::chrono::milliseconds>(deadline - farmem::Clock::now());
    if (left.count() <= 0) {
      return farmem::Err(farmem::Unavailable(fmt::format(
          "no farmem daemon of {} answered within --peer-wait-ms {} ms (last attempt: {}). Start "
          "the daemons (farmemd) first, check the addresses, or give a longer --peer-wait-ms",
          what, cfg.peer_wait_ms, cluster.error().ToString())));
    }
    if (!logged) {
      logged = true;
      spdlog::warn(
          "farmem-nbd: no farmem daemon answers yet ({}); waiting up to {} ms (--peer-wait-ms) "
          "for the first of {}",
          cluster.error().ToString(), cfg.peer_wait_ms, what);
    }
    // Pacing between connection attempts (nothing to wait on: the daemons are not there yet).
    std::this_thread::sleep_for(std::min<std::chrono::milliseconds>(retry, left));
  }
}

}  // namespace

Result<std::unique_ptr<BlockBackend>> OpenBackend(BackendConfig& cfg) {
  if (cfg.kind == "farmem") {
    FARMEM_RETURN_IF_ERROR(ResolveLayout(&cfg));
    farmem::client::ClusterOptions co;
    FARMEM_ASSIGN_OR_RETURN(co.peers, farmem::ParseEndpointList(cfg.peers, farmem::kDefaultPort));
    co.peers_dns = cfg.peers_dns;
    co.transport = cfg.transport;
    co.client_name = "farmem-nbd";
    co.heartbeat_interval = std::chrono::milliseconds(cfg.heartbeat_ms);
    co.failure_timeout = std::chrono::milliseconds(cfg.failure_timeout_ms);
    FARMEM_ASSIGN_OR_RETURN(farmem::auth::ClientKeyFile cred,
                            farmem::auth::LoadClientCredentials(cfg.secret_file, cfg.key_file));
    co.secret = std::move(cred.key);
    co.identity = std::move(cred.identity);
    if (co.peers.empty() && co.peers_dns.empty()) {
      return farmem::Err(farmem::InvalidArgument("--backend farmem needs --peers or --peers-dns"));
    }
    // One --peer-wait-ms for the whole start: the first daemon, then every peer.
    const farmem::Deadline peer_deadline =
        farmem::DeadlineIn(std::chrono::milliseconds(cfg.peer_wait_ms));
    FARMEM_ASSIGN_OR_RETURN(cfg.cluster, ConnectCluster(co, cfg, peer_deadline));
    farmem::blockdev::PageStoreOptions po;
    FARMEM_ASSIGN_OR_RETURN(po.size, farmem::ParseSize(cfg.size));
    FARMEM_ASSIGN_OR_RETURN(po.resilience, farmem::blockdev::Resilience::Parse(cfg.resilience));
    FARMEM_RETURN_IF_ERROR(CheckExportFits(
        *cfg.cluster, cfg, po.size, po.resilience,
        std::max(std::chrono::milliseconds(0),
                 std::chrono::duration_cast<std::chrono::milliseconds>(peer_deadline -
                                                                       farmem::Clock::now()))));
    po.backup_path = cfg.backup;
    po.encrypt = cfg.encrypt;
    po.busy_poll = std::chrono::microseconds(cfg.busy_poll_us);
    if (!cfg.encrypt) {
      spdlog::warn(
          "farmem-nbd: --no-encrypt: pages are stored IN PLAINTEXT on the lenders{} and are not "
          "authenticated when read back: whoever has root on a lender, or its crash dumps, can "
          "read and change them. Use it for benchmarks only",
          cfg.backup.empty() ? "" : " and in the backup file");
    } else if (!cfg.data_key_file.empty()) {
      bool created = false;
      auto key = farmem::aead::LoadOrCreateDataKeyFile(cfg.data_key_file, &created);
      if (!key) return farmem::Err(key.error().WithContext("--data-key-file"));
      po.data_key = *key;
      spdlog::info("farmem-nbd: pages encrypted with the data key {} {}",
                   created ? "created in" : "from", cfg.data_key_file);
    }
    if (cfg.encrypt) spdlog::info("farmem-nbd: {}", farmem::aead::DescribeChosenImpl());
    std::unique_ptr<BlockBackend> store;
    if (cfg.ec_layout == "stripe") {
      farmem::blockdev::StripeStoreOptions so;
      so.size = po.size;
      so.resilience = po.resilience;
      so.encrypt = po.encrypt;
      so.data_key = po.data_key;
      so.busy_poll = po.busy_poll;
      so.backup_path = cfg.backup;
      so.compaction_offload = cfg.compaction_offload;
      so.lease_ahead = cfg.lease_ahead;
      FARMEM_ASSIGN_OR_RETURN(
          store, farmem::blockdev::StripeStore::Create(cfg.cluster.get(), std::move(so)));
    } else {
      FARMEM_ASSIGN_OR_RETURN(
          store, farmem::blockdev::PageStore::Create(cfg.cluster.get(), std::move(po)));
    }
    if (cfg.write_cache_pages == 0) {
      spdlog::info(
          "farmem-nbd: write cache off: each write smaller than 4 KiB reads, patches "
          "and writes back its page before it is answered");
      return std::unique_ptr<BlockBackend>(std::move(store));
    }
    farmem::blockdev::WriteCacheOptions wo;
    wo.pages = cfg.write_cache_pages;
    wo.max_dirty_age = std::chrono::milliseconds(cfg.write_cache_max_age_ms);
    if (auto* ss = dynamic_cast<farmem::blockdev::StripeStore*>(store.get()); ss != nullptr) {
      ss->TuneWriteCache(wo);
    } else if (auto* ps = dynamic_cast<farmem::blockdev::PageStore*>(store.get()); ps != nullptr) {
      ps->TuneWriteCache(wo);
    }
    FARMEM_ASSIGN_OR_RETURN(auto cache,
                            farmem::blockdev::WriteCache::Create(std::move(store), std::move(wo)));
    spdlog::info(
        "farmem-nbd: write cache of {} pages ({}){}: writes are durable on FLUSH or FUA, or {} ms "
        "after they were made",
        cfg.write_cache_pages, farmem::FormatSize(uint64_t{cfg.write_cache_pages} * 4096),
        wo.absorb_writes_below_pages > 0
            ? fmt::format(", holding whole-page writes of fewer than {} pages too",
                          wo.absorb_writes_below_pages)
            : std::string(),
        cfg.write_cache_max_age_ms);
    return std::unique_ptr<BlockBackend>(std::move(cache));
  }
  if (cfg.kind == "memory") {
    FARMEM_ASSIGN_OR_RETURN(uint64_t size, farmem::ParseSize(cfg.size));
    FARMEM_ASSIGN_OR_RETURN(auto backend, farmem::blockdev::MemoryBackend::Create(size));
    return std::unique_ptr<BlockBackend>(std::move(backend));
  }
  return farmem::Err(farmem::InvalidArgument("unknown backend '" + cfg.kind + "'"));
}

namespace {
// What only the stripe layout has (StripeStoreStats: space, stripes written, compaction and its
// offload), read at scrape time like the rest.
void RegisterStripeMetrics(farmem::metrics::Registry* r, farmem::blockdev::StripeStore* ss) {
  using farmem::metrics::Type;
  using Emit = farmem::metrics::Registry::Emit;
  using Stats = farmem::blockdev::StripeStoreStats;
  auto stat = [&](const char* name, const char* help, Type type, auto value) {
    r->AddCallback(name, help, type, [ss, value](const Emit& emit) {
      emit({}, static_cast<double>(value(ss->stripe_stats())));
    });
  };
  stat("farmem_export_stripe_live_pages", "Stripe layout: pages with a cell.", Type::kGauge,
       [](const Stats& s) { return s.live_pages; });
  stat("farmem_export_stripe_sets", "Stripe layout: stripes in use.", Type::kGauge,
       [](const Stats& s) { return s.sets; });
  stat("farmem_export_stripe_set_bytes",
       "Stripe layout: bytes of the rows in use (stripes x (k + r) x 4 KiB); over (k + r) / k x "
       "live pages x 4 KiB: the space amplification compaction holds under its trigger.",
       Type::kGauge, [](const Stats& s) { return s.set_bytes; });
  stat("farmem_export_stripe_leased_bytes",
       "Stripe layout: memory leased from the daemons (whole slab groups).", Type::kGauge,
       [](const Stats& s) { return s.leased_bytes; });
  stat("farmem_export_stripe_groups_leased_ahead_total",
       "Stripe layout: slab groups (k + r slabs) leased in the background before writes needed "
       "them.",
       Type::kCounter, [](const Stats& s) { return s.groups_leased_ahead; });
  stat("farmem_export_stripe_groups_leased_by_writers_total",
       "Stripe layout: slab groups a write had to lease itself, waiting for k + r ALLOCs (the "
       "first group; later ones only when writes outran the background lease or it failed).",
       Type::kCounter, [](const Stats& s) { return s.groups_leased_by_writers; });
  stat("farmem_export_stripe_sets_written_total", "Stripe layout: stripes written by writes.",
       Type::kCounter, [](const Stats& s) { return s.sets_written; });
  stat("farmem_export_stripe_short_sets_written_total",
       "Stripe layout: of those, stripes with fewer than k pages (zero holes).", Type::kCounter,
       [](const Stats& s) { return s.short_sets; });
  stat("farmem_export_stripe_compactions_total",
       "Stripe layout: compaction passes that moved pages.", Type::kCounter,
       [](const Stats& s) { return s.compactions; });
  stat("farmem_export_stripe_compacted_pages_total",
       "Stripe layout: pages moved by compaction into full stripes.", Type::kCounter,
       [](const Stats& s) { return s.pages_compacted; });
  stat("farmem_export_stripe_compaction_offloaded_sets_total",
       "Stripe layout, --compaction-offload: stripes the daemons assembled themselves.",
       Type::kCounter, [](const Stats& s) { return s.compaction_offloaded_sets; });
  stat("farmem_export_stripe_compaction_offload_fallbacks_total",
       "Stripe layout, --compaction-offload: passes that fell back to moving the pages through "
       "this client.",
       Type::kCounter, [](const Stats& s) { return s.compaction_offload_fallbacks; });
  stat("farmem_export_stripe_compaction_sent_bytes_total",
       "Stripe layout: bytes this client sent for compaction (data-path and offload requests).",
       Type::kCounter, [](const Stats& s) { return s.compaction_bytes_sent; });
  stat("farmem_export_stripe_compaction_received_bytes_total",
       "Stripe layout: bytes this client received for compaction.", Type::kCounter,
       [](const Stats& s) { return s.compaction_bytes_received; });
  stat("farmem_export_stripe_compaction_cpu_seconds_total",
       "Stripe layout: CPU time of the compacting thread.", Type::kCounter,
       [](const Stats& s) { return static_cast<double>(s.compaction_cpu_ns) / 1e9; });
}
}  // namespace

// The export's health for --metrics-listen, read at scrape time from the page store's stats and
// the cluster's view of each daemon (docs/operations.md "Metrics"); nothing on the data path.
void RegisterExportMetrics(farmem::metrics::Registry* r, BackendConfig* cfg, BlockBackend* backend,
                           const std::string& export_name) {
  using farmem::metrics::Type;
  using Emit = farmem::metrics::Registry::Emit;
  auto* cache = dynamic_cast<farmem::blockdev::WriteCache*>(backend);
  BlockBackend* inner = cache != nullptr ? cache->inner() : backend;
  // The page store's stats and encryption, from whichever layout serves the export (the stripe
  // layout fills the PageStoreStats that apply to it: docs/nbd.md "Stripe layout").
  struct StoreView {
    std::function<farmem::blockdev::PageStoreStats()> stats;
    bool encrypted = false;
  };
  std::shared_ptr<StoreView> store;
  if (auto* ps = dynamic_cast<farmem::blockdev::PageStore*>(inner); ps != nullptr) {
    store = std::make_shared<StoreView>(StoreView{[ps] { return ps->stats(); }, ps->encrypted()});
  } else if (auto* ss = dynamic_cast<farmem::blockdev::StripeStore*>(inner); ss != nullptr) {
    store = std::make_shared<StoreView>(StoreView{[ss] { return ss->stats(); }, ss->encrypted()});
  }
  if (cache != nullptr) {
    using CacheStats = farmem::blockdev::WriteCacheStats;
    auto cstat = [&](const char* name, const char* help, Type type, auto value) {
      r->AddCallback(name, help, type, [cache, value](const Emit& emit) {
        emit({}, static_cast<double>(value(cache->stats())));
      });
    };
    cstat("farmem_write_cache_pages", "Capacity of the write cache, in 4 KiB pages.", Type::kGauge,
          [](const CacheStats& s) { return s.pages; });
    cstat("farmem_write_cache_dirty_pages",
          "Pages of the write cache not yet written back to the page store.", Type::kGauge,
          [](const CacheStats& s) { return s.dirty; });
    cstat("farmem_write_cache_fills_total",
          "Partly written pages whose other sectors were read from the page store to write "
          "them back.",
          Type::kCounter, [](const CacheStats& s) { return s.fills; });
    cstat("farmem_write_cache_writebacks_total", "Pages written back to the page store.",
          Type::kCounter, [](const CacheStats& s) { return s.writebacks; });
    cstat("farmem_write_cache_writeback_failures_total",
          "Page write-backs that failed (the page stays dirty and is retried; the next FLUSH "
          "fails).",
          Type::kCounter, [](const CacheStats& s) { return s.writeback_failures; });
  }
  // The AES-256-GCM implementation the page store's ciphers use (empty with --no-encrypt).
  std::string aead;
  if (cfg->kind == "farmem" && cfg->encrypt) {
    auto impl = farmem::aead::ChosenImpl();
    if (impl) aead = std::string(farmem::aead::ImplName(*impl));
  }
  r->AddCallback("farmem_export_info",
                 "This export: program version, backend, resilience, ec layout (stripe or "
                 "split; empty unless ec:k+r), transport and the AES-256-GCM implementation "
                 "(ipsec-mb or openssl; empty with --no-encrypt).",
                 Type::kGauge, [cfg, export_name, aead](const Emit& emit) {
                   emit({{"version", std::string(farmem::kVersionString)},
                         {"export", export_name},
                         {"backend", cfg->kind},
                         {"resilience", cfg->kind == "farmem" ? cfg->resilience : ""},
                         {"ec_layout", cfg->kind == "farmem" ? cfg->ec_layout : ""},
                         {"transport", cfg->kind == "farmem" ? cfg->transport : ""},
                         {"aead", aead}},
                        1);
                 });
  r->AddCallback("farmem_export_size_bytes", "Size of the export.", Type::kGauge,
                 [backend](const Emit& emit) { emit({}, static_cast<double>(backend->size())); });
  if (store == nullptr) return;
  using Stats = farmem::blockdev::PageStoreStats;
  auto stat = [&](const char* name, const char* help, Type type, auto value) {
    r->AddCallback(name, help, type,
                   [store, value](const Emit& emit) { emit({}, value(store->stats())); });
  };
  auto d = [](uint64_t v) { return static_cast<double>(v); };
  stat("farmem_export_extents_mapped", "Extents of the export mapped to remote slabs.",
       Type::kGauge, [d](const Stats& s) { return d(s.extents_mapped); });
  stat("farmem_export_degraded_extents",
       "Mapped extents with a member missing (re-protection pending or running).", Type::kGauge,
       [d](const Stats& s) { return d(s.degraded_extents); });
  stat("farmem_export_rebuild_in_progress",
       "1 while the rebuild thread re-protects degraded extents or has work queued.", Type::kGauge,
       [](const Stats& s) { return s.rebuild_running ? 1.0 : 0.0; });
  stat("farmem_export_rebuild_queued", "Extents and lost leases queued for the rebuild thread.",
       Type::kGauge, [d](const Stats& s) { return d(s.rebuild_queued); });
  stat("farmem_export_episode_reprotected_extents",
       "Extents made whole again in the current degraded episode (0 when whole).", Type::kGauge,
       [d](const Stats& s) { return d(s.episode_reprotected_extents); });
  stat("farmem_export_episode_reprotect_seconds",
       "How long re-protection has been running in the current degraded episode.", Type::kGauge,
       [d](const Stats& s) { return d(s.episode_reprotect_ms) / 1000; });
  stat("farmem_export_episode_degraded_seconds",
       "How long the export has been degraded (0 when whole).", Type::kGauge,
       [d](const Stats& s) { return d(s.episode_degraded_ms) / 1000; });
  stat("farmem_export_rebuilds_total", "Members rebuilt on another daemon.", Type::kCounter,
       [d](const Stats& s) { return d(s.rebuilds); });
  stat("farmem_export_reprotected_extents_total", "Degraded extents made whole again.",
       Type::kCounter, [d](const Stats& s) { return d(s.reprotected_extents); });
  stat("farmem_export_rebuilt_bytes_total", "Bytes written to replacement members.", Type::kCounter,
       [d](const Stats& s) { return d(s.rebuilt_bytes); });
  stat("farmem_export_moved_members_total",
       "Members on a lender that gave notice (drain, memory pressure) copied to another daemon in "
       "time.",
       Type::kCounter, [d](const Stats& s) { return d(s.moved_members); });
  stat("farmem_export_moved_bytes_total", "Bytes copied by those moves.", Type::kCounter,
       [d](const Stats& s) { return d(s.moved_bytes); });
  stat("farmem_export_moves_missed_total",
       "Noticed members not moved before their deadline or failure: re-protected like lost ones.",
       Type::kCounter, [d](const Stats& s) { return d(s.moves_missed); });
  stat("farmem_export_copies_abandoned_total",
       "Re-protection or move copies that gave their target up (it failed or was noticed) and "
       "were done again elsewhere.",
       Type::kCounter, [d](const Stats& s) { return d(s.copies_abandoned); });
  stat("farmem_export_degraded_reads_total",
       "Reads that needed decoding, another replica or the backup file.", Type::kCounter,
       [d](const Stats& s) { return d(s.degraded_reads); });
  stat("farmem_export_backup_reads_total", "Reads served from the backup file.", Type::kCounter,
       [d](const Stats& s) { return d(s.backup_reads); });
  stat("farmem_export_write_retries_total", "Writes retried after a member failed.", Type::kCounter,
       [d](const Stats& s) { return d(s.write_retries); });
  stat("farmem_export_lost_bytes_total",
       "Bytes of written data lost for good (no copy left, no backup). Must stay 0.",
       Type::kCounter, [d](const Stats& s) { return d(s.lost_bytes); });
  stat("farmem_export_integrity_failures_total",
       "Reads of a page whose copy failed authentication (changed on a lender or in transit): "
       "served from other members or the backup file, or an error for that page; never returned.",
       Type::kCounter, [d](const Stats& s) { return d(s.integrity_failures); });
  r->AddCallback("farmem_export_encrypted",
                 "1 when pages are encrypted and authenticated (the default), 0 with --no-encrypt.",
                 Type::kGauge,
                 [store](const Emit& emit) { emit({}, store->encrypted ? 1.0 : 0.0); });
  stat("farmem_export_last_reprotect_seconds",
       "The last degraded episode: how long re-protection took.", Type::kGauge,
       [d](const Stats& s) { return d(s.last_reprotect_ms) / 1000; });
  stat("farmem_export_last_degraded_seconds",
       "The last degraded episode: how long the export was degraded.", Type::kGauge,
       [d](const Stats& s) { return d(s.last_degraded_ms) / 1000; });
  stat("farmem_export_last_reprotect_bytes",
       "The last degraded episode: bytes written to replacement members.", Type::kGauge,
       [d](const Stats& s) { return d(s.last_reprotect_bytes); });
  stat("farmem_export_degraded_episodes_total",
       "Times the export went from whole to degraded (a member lost, or mapped with members "
       "missing).",
       Type::kCounter, [d](const Stats& s) { return d(s.degraded_episodes); });
  stat("farmem_export_last_move_seconds",
       "The last move (split layout: the last burst of eviction notices; stripe layout: the last "
       "member moved): from the notice until the member was moved.",
       Type::kGauge, [d](const Stats& s) { return d(s.last_move_ms) / 1000; });
  stat("farmem_export_last_move_bytes", "The bytes that last move copied.", Type::kGauge,
       [d](const Stats& s) { return d(s.last_move_bytes); });
  stat("farmem_export_cluster_free_slabs", "Free slabs on the live daemons (last capacity check).",
       Type::kGauge, [d](const Stats& s) { return d(s.cluster_free_slabs); });
  stat("farmem_export_slabs_needed",
       "Slabs this export still needs to map all of itself and re-protect what is degraded.",
       Type::kGauge, [d](const Stats& s) { return d(s.slabs_needed); });
  if (auto* ss = dynamic_cast<farmem::blockdev::StripeStore*>(inner); ss != nullptr) {
    RegisterStripeMetrics(r, ss);
  }
  farmem::client::Cluster* cluster = cfg->cluster.get();
  // Per daemon: 1 for its state (up, suspect, down), and the slabs this export holds there.
  r->AddCallback("farmem_export_daemon_state",
                 "Each daemon as this export sees it: 1 for its current state (up, suspect: a "
                 "data-path error within its suspect window, down).",
                 Type::kGauge, [cluster](const Emit& emit) {
                   for (farmem::client::NodeId id = 0; id < cluster->node_count(); ++id) {
                     const farmem::client::NodeInfo n = cluster->node(id);
                     const char* state = !n.alive ? "down" : n.suspect ? "suspect" : "up";
                     for (const char* s : {"up", "suspect", "down"}) {
                       emit({{"daemon", n.endpoint.ToString()}, {"state", s}},
                            std::string_view(s) == state ? 1 : 0);
                     }
                   }
                 });
  r->AddCallback(
      "farmem_export_daemon_leased_bytes", "Memory this export holds on each daemon (placement).",
      Type::kGauge, [cluster](const Emit& emit) {
        for (farmem::client::NodeId id = 0; id < cluster->node_count(); ++id) {
          const farmem::client::NodeInfo n = cluster->node(id);
          const uint64_t slab = n.stat ? n.stat->slab_size : 0;
          emit({{"daemon", n.endpoint.ToString()}}, static_cast<double>(n.leases_held * slab));
        }
      });
}
}  // namespace farmem::blockdev
