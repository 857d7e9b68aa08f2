// GATHER_CELL's reply body (docs/wire-protocol.md, "GATHER_CELL"): the CRC-32C of every source
// cell as the daemon read it, and of the cell it stored. Kept apart from wire.h, which nearly
// every file includes, because only the daemon's offload and far_ptr's compaction speak it.
//
//   source_count u16, reserved u16 (0), source_crc u32 x source_count, cell_crc u32
//
// A daemon that predates the reply sends an empty body: the caller then knows nothing of the
// sources (far_ptr's compactor moves the bytes itself instead).
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "farmem/common/status.h"
#include "farmem/common/wire.h"

namespace farmem::wire {

struct GatherCellReply {
  std::vector<uint32_t> source_crcs;  // in the request's source order
  uint32_t cell_crc = 0;              // of the cell stored
};

inline void EncodeGatherCellReply(const GatherCellReply& m, std::vector<uint8_t>* out) {
  out->clear();
  Writer w(out);
  w.U16(static_cast<uint16_t>(m.source_crcs.size()));
  w.U16(0);
  for (uint32_t c : m.source_crcs) w.U32(c);
  w.U32(m.cell_crc);
}

// `sources`: how many the request named; the body must be exactly what they make.
inline Result<GatherCellReply> DecodeGatherCellReply(std::span<const uint8_t> body,
                                                     size_t sources) {
  const size_t want = 4 + 4 * sources + 4;
  if (body.size() != want) {
    return Err(ProtocolError("GATHER_CELL reply of " + std::to_string(body.size()) + " bytes; " +
                             std::to_string(sources) + " sources make " + std::to_string(want)));
  }
  Reader r(body);
  GatherCellReply m;
  const uint16_t n = r.U16();
  (void)r.U16();
  if (n != sources) {
    return Err(ProtocolError("GATHER_CELL reply names " + std::to_string(n) + " sources, not " +
                             std::to_string(sources)));
  }
  m.source_crcs.resize(n);
  for (uint32_t& c : m.source_crcs) c = r.U32();
  m.cell_crc = r.U32();
  return m;
}

}  // namespace farmem::wire
