// Test hooks of far_ptr's encryption (farptr/src/span_crypto.h). Not a public API: only tests
// include this header. Nothing here is called unless a test installs it.
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include "farmem/client/cluster.h"
#include "farmem/common/aead.h"
#include "farmem/common/status.h"

namespace farmem::farptr_internal {

struct ObjectEntry;

// Called with every nonce any runtime seals an object under, and the id of the runtime key it
// used (a fingerprint of the key: each runtime derives a key of its own, so nonces need only be
// unique per key id, and two runtimes on one data key must show different ids). From the
// sealing thread; install before creating runtimes, remove (nullptr) after destroying them.
using SealObserver = std::function<void(uint64_t key_id, const aead::Nonce& nonce)>;
void SetSealObserverForTest(SealObserver observer);

// Where the bytes of a remote object lie: one place per member that holds them (the data member,
// and every copy with replicate), each the lease and the byte offset of the object's slot in the
// slab. NotFound if the object is local or has no remote cell.
struct ObjectPlace {
  client::Lease lease;
  uint64_t offset = 0;
  uint32_t length = 0;  // the object's bytes (the slot starts at `offset`)
  // The bytes of its sealed form from `offset`: with encryption, its ciphertext (`length`) and
  // then its GCM tag, when the tag is in the slot (span_crypto.h); else `length`.
  uint32_t sealed_length = 0;
};
Result<std::vector<ObjectPlace>> LocateObjectForTest(ObjectEntry* e);

}  // namespace farmem::farptr_internal
