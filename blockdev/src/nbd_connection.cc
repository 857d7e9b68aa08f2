// Connection setup: greeting and option haggling. The request path is in nbd_transmission.cc.
#include "nbd_connection.h"

#include <spdlog/spdlog.h>
#include <sys/socket.h>
#include <sys/time.h>

#include <vector>

#include "farmem/common/socket.h"

namespace farmem::blockdev {

NbdConnection::NbdConnection(int fd, std::string peer, BlockBackend* backend,
                             const nbd::ExportInfo* info, NbdMetrics* metrics,
                             std::chrono::milliseconds handshake_timeout,
                             std::chrono::milliseconds reply_timeout,
                             std::chrono::microseconds request_busy_poll)
    : fd_(fd),
      peer_(std::move(peer)),
      backend_(backend),
      info_(info),
      handshake_timeout_(handshake_timeout),
      reply_timeout_(reply_timeout),
      metrics_(metrics) {
  request_spin_.set_budget(request_busy_poll);
}

void NbdConnection::Run() {
  spdlog::debug("nbd: connection from {}", peer_);
  if (!Negotiate()) return;
  spdlog::info("nbd: {} entered transmission (structured replies: {}, flags 0x{:04x})", peer_,
               session_.structured_replies, session_.transmission_flags);
  if (metrics_ != nullptr) metrics_->connections->Add();
  Transmit();
  spdlog::info(
      "nbd: {} closed after {} requests in {} batches, {} replies sent early ({} failed), {} "
      "batches waited for the client to read: {}",
      peer_, requests_, batches_, early_replies_, failed_requests_, reply_stalls_, end_reason_);
}

bool NbdConnection::Negotiate() {
  std::vector<uint8_t> out;
  out.reserve(256);
  nbd::OptionNegotiator::Greeting(&out);
  if (!SendAll(fd_, out, DeadlineIn(handshake_timeout_)).ok()) {
    spdlog::debug("nbd: {} went away before the greeting was sent", peer_);
    return false;
  }
  nbd::OptionNegotiator neg(info_);
  // Big enough for the largest option read into memory and for one step of skipping.
  std::vector<uint8_t> buf(std::max<size_t>(nbd::kMaxOptionLen, 64u << 10));
  using State = nbd::OptionNegotiator::State;
  while (neg.state() != State::kTransmission && neg.state() != State::kClosed) {
    const size_t want = neg.bytes_wanted();
    Status s = RecvExact(fd_, std::span<uint8_t>(buf.data(), want), DeadlineIn(handshake_timeout_));
    if (!s.ok()) {
      spdlog::debug("nbd: {} handshake ended: {}", peer_, s.ToString());
      return false;
    }
    out.clear();
    neg.Feed(std::span<const uint8_t>(buf.data(), want), &out);
    if (!out.empty() && !SendAll(fd_, out, DeadlineIn(handshake_timeout_)).ok()) {
      spdlog::debug("nbd: {} went away during the handshake", peer_);
      return false;
    }
  }
  if (neg.state() == State::kClosed) {
    spdlog::info("nbd: {} handshake closed: {}", peer_, neg.close_reason());
    return false;
  }
  session_.export_size = info_->size;
  session_.transmission_flags = neg.transmission_flags();
  session_.structured_replies = neg.structured_replies();
  return true;
}

}  // namespace farmem::blockdev
