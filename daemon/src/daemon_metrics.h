// The metrics farmemd serves on --metrics-listen (docs/operations.md "Metrics"): registered once
// at start; every value is read at scrape time from what the server and the pool keep anyway
// (ServerCounters, PoolStats), so serving metrics adds nothing to the data path.
// Threading: call before serving; the callbacks run on the metrics HTTP thread.
#pragma once

#include "farmem/common/metrics.h"
#include "server.h"
#include "slab_pool.h"

namespace farmem::daemon {

void RegisterDaemonMetrics(metrics::Registry* registry, Server* server, SlabPool* pool);

}  // namespace farmem::daemon
