// Offload: the computation of the daemon-to-daemon offload requests of one client connection
// (docs/wire-protocol.md): PARITY_ENCODE reads the k data cells from their daemons and stores one
// parity cell here; GATHER_CELL builds one cell here from pieces of cells on other daemons. It
// reads those cells through a PeerReader, as the connection's client, and stores the result only
// once complete (a failed request leaves the old cell as it was). Connection frames the requests
// and replies; this class only computes.
// Thread-safety: none; owned and used by its connection's thread.
#pragma once

#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "farmem/common/status.h"
#include "farmem/common/wire.h"
#include "farmem/ec/reed_solomon.h"
#include "peer_reader.h"

namespace farmem::daemon {

class Server;

class Offload {
 public:
  // `client_id` and `identity`: who the client is (what PeerReader presents to other daemons);
  // `owner`: the lease owner they make (auth::LeaseOwner), for this daemon's own leases.
  Offload(Server* server, const wire::ClientId& client_id, std::string identity,
          const wire::ClientId& owner, std::string client_name);
  ~Offload();
  Offload(const Offload&) = delete;
  Offload& operator=(const Offload&) = delete;

  // *reply stays empty (PARITY_ENCODE's reply has no body).
  Status ParityEncode(const wire::ParityEncodeRequest& req, std::vector<uint8_t>* reply);
  // *reply: the GATHER_CELL reply body (farmem/common/wire_gather.h): the CRC-32C of each source
  // cell as read and of the cell stored, so the client can tell a source that was corrupted here
  // (a bit flip in a lender's memory) from the one it wrote, without this daemon holding its key.
  Status GatherCell(const wire::GatherCellRequest& req, std::vector<uint8_t>* reply);

 private:
  PeerReader& Peers();  // created on first use

  Server* const server_;
  const wire::ClientId client_id_;
  const std::string identity_;
  const wire::ClientId owner_;
  const std::string client_name_;
  std::unique_ptr<PeerReader> peers_;
  std::map<std::pair<int, int>, std::unique_ptr<ec::ReedSolomon>> codecs_;  // by (k, r)
  std::vector<uint8_t> parity_;  // the cell being computed
  std::vector<uint8_t> cells_;   // the source cells as they arrive
};

}  // namespace farmem::daemon
