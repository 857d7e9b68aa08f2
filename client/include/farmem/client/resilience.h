// Resilience: how a borrower protects what it keeps on the daemons — the one parser, printer and
// meaning of "none", "replicate:N" and "ec:k+r", shared by the page store (farmem-nbd) and far_ptr.
//
// One meaning for both: a group is k + r members on k + r distinct daemons, any k of which can
// produce the data, so a group survives r lost members.
//   none          k = 1, r = 0
//   replicate:N   k = 1, r = N - 1 (N full copies: any one of them has the data)
//   ec:k+r        k data fragments + r parity fragments (Reed-Solomon)
//
// Limits. Parse checks the ones every borrower shares: k + r <= kMaxGroupSize (32) and
// replicate:N with N <= kMaxCopies (8). Each borrower narrows them with its own Parse, which
// calls this one and adds exactly one rule, stated where it is checked:
//   page store (blockdev::Resilience, page_store.h): k divides 4096 (a page is cut into k equal
//     fragments);
//   far_ptr (SpanResilience, farmem/runtime.h): k + r <= 16 (a span set's members are kept in
//     fixed arrays of farptr_internal::kMaxSetWidth on the request path).
// Thread-safety: a value type.
#pragma once

#include <string>
#include <string_view>

#include "farmem/common/status.h"

namespace farmem::client {

struct Resilience {
  // k + r is at most this: both borrowers and ec::ReedSolomon (ec::kMaxFragments) keep the
  // members of a group as 32-bit masks.
  static constexpr int kMaxGroupSize = 32;
  // replicate:N takes N from 1 to this. Not a hard limit of the code: N copies cost N times the
  // memory and the write traffic, and past 8 another mode (ec:k+r) protects better for less.
  static constexpr int kMaxCopies = 8;

  enum class Mode { kNone, kReplicate, kErasure };
  Mode mode = Mode::kErasure;
  int k = 4;  // members any one read needs: data fragments (ec), 1 (none, replicate)
  int r = 2;  // members a group can lose: parity fragments (ec), extra copies (replicate)

  // "none", "replicate:N" (1 <= N <= kMaxCopies), "ec:k+r" (k >= 1, r >= 0,
  // k + r <= max_group_size, which a borrower may lower below kMaxGroupSize).
  static Result<Resilience> Parse(std::string_view text, int max_group_size = kMaxGroupSize);
  std::string ToString() const;
  // Daemons one group is spread over.
  int group_size() const { return k + r; }
  // The fewest members a group can live with (read its data back from): k.
  int min_members() const { return k; }
};

}  // namespace farmem::client
