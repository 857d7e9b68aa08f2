// The synchronous conveniences every Channel gets from Post/Flush/Poll.
#include <fmt/format.h>

#include <vector>

#include "farmem/transport/transport.h"

namespace farmem::transport {

Status Channel::Execute(std::span<const Op> ops, std::span<Status> results,
                        std::chrono::milliseconds timeout) {
  if (!results.empty() && results.size() != ops.size()) {
    return InvalidArgument("Execute: results must be empty or one per op");
  }
  if (outstanding() != 0) {
    return InvalidArgument("Execute needs a channel with no operations outstanding");
  }
  Status first;
  size_t next = 0, done = 0;
  Completion comps[64];
  while (done < ops.size()) {
    bool posted = false;
    while (next < ops.size() && outstanding() < max_outstanding()) {
      Op op = ops[next];
      op.user_data = next;
      Status s = Post(op);
      if (!s.ok()) {
        if (!results.empty()) results[next] = s;
        if (first.ok()) first = s;
        ++done;
      } else {
        posted = true;
      }
      ++next;
    }
    if (posted) {
      Status s = Flush();
      if (!s.ok() && first.ok()) first = s;  // the ops complete with errors below
    }
    if (done == ops.size()) break;
    FARMEM_ASSIGN_OR_RETURN(size_t n, Poll(comps, timeout));
    if (n == 0 && outstanding() == 0 && next == ops.size()) {
      return Internal(
          fmt::format("Execute on {}: {} operations never completed", peer(), ops.size() - done));
    }
    for (size_t i = 0; i < n; ++i) {
      if (!results.empty()) results[comps[i].user_data] = comps[i].status;
      if (!comps[i].status.ok() && first.ok()) first = comps[i].status;
      ++done;
    }
  }
  return first;
}

Status Channel::Read(const RemoteSlab& slab, uint64_t offset, std::span<uint8_t> dst,
                     const LocalRegion* region) {
  Op op{OpType::kRead, slab, offset, dst.data(), static_cast<uint32_t>(dst.size()), region, 0};
  if (dst.size() > wire::kMaxDataLen) {
    return InvalidArgument(
        fmt::format("read of {} bytes exceeds {}", dst.size(), wire::kMaxDataLen));
  }
  return Execute({&op, 1});
}

Status Channel::Write(const RemoteSlab& slab, uint64_t offset, std::span<const uint8_t> src,
                      const LocalRegion* region) {
  Op op{OpType::kWrite,
        slab,
        offset,
        const_cast<uint8_t*>(src.data()),
        static_cast<uint32_t>(src.size()),
        region,
        0};
  if (src.size() > wire::kMaxDataLen) {
    return InvalidArgument(
        fmt::format("write of {} bytes exceeds {}", src.size(), wire::kMaxDataLen));
  }
  return Execute({&op, 1});
}

}  // namespace farmem::transport
