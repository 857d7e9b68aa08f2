// far_hash_map<K, V>: a hash map whose entries live in far memory, usable with a local budget far
// below its size.
//
// Layout: a local directory of buckets (one far_bytes pointer, 8 bytes, per bucket; about one
// byte of local memory per entry at the default load) and, per bucket, one far object holding
// its entries inline: {count, capacity, (K, V) x capacity}. A lookup is one hash, one deref of one
// small object (local: a few instructions; remote: one span swap-in) and a short linear scan.
// A bucket that fills up is reallocated at twice the capacity; the directory doubles when the
// average bucket passes kMaxLoad entries (a full rehash, under an exclusive lock).
//
// Values are returned by copy, so nothing a caller holds points into far memory.
//
// Threads: every method may be called from any thread concurrently. Buckets are guarded by
// striped reader/writer locks (find shares, insert/erase exclude); a directory resize excludes
// everyone. Locks are taken before the internal DerefScope is entered.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <optional>
#include <type_traits>
#include <vector>

#include "farmem/common/mutex.h"
#include "farmem/far_ptr.h"

namespace farmem {

template <typename K, typename V, typename Hash = std::hash<K>, typename Eq = std::equal_to<K>>
class far_hash_map {
  static_assert(std::is_trivially_copyable_v<K> && std::is_trivially_copyable_v<V>,
                "far_hash_map keys and values must be trivially copyable");

 public:
  static constexpr size_t kMaxLoad = 8;  // average entries per bucket before the directory grows
  static constexpr size_t kStripes = 256;

  explicit far_hash_map(Runtime& rt, size_t expected_size = 0)
      : rt_(&rt), stripes_(std::make_unique<SharedMutex[]>(kStripes)) {
    size_t n = 64;
    while (n * kMaxLoad / 2 < expected_size) n *= 2;
    buckets_.resize(n);
  }
  far_hash_map(const far_hash_map&) = delete;
  far_hash_map& operator=(const far_hash_map&) = delete;

  size_t size() const { return size_.load(std::memory_order_relaxed); }
  size_t bucket_count() const {
    ReaderLock r(&resize_mu_);
    return buckets_.size();
  }

  std::optional<V> find(const K& key) const {
    const size_t h = Hash{}(key);
    ReaderLock r(&resize_mu_);
    const size_t b = h & (buckets_.size() - 1);
    ReaderLock l(&stripes_[b % kStripes]);
    if (!buckets_[b]) return std::nullopt;
    DerefScope s;
    std::span<const std::byte> bytes = buckets_[b].deref(s);
    const Header hd = ReadHeader(bytes);
    for (uint32_t i = 0; i < hd.count; ++i) {
      Item it = ReadItem(bytes, i);
      if (Eq{}(it.key, key)) return it.value;
    }
    return std::nullopt;
  }

  bool contains(const K& key) const { return find(key).has_value(); }

  // Inserts or overwrites; true if the key was new.
  bool insert(const K& key, const V& value) {
    bool added = false;
    {
      const size_t h = Hash{}(key);
      ReaderLock r(&resize_mu_);
      const size_t b = h & (buckets_.size() - 1);
      WriterLock l(&stripes_[b % kStripes]);
      added = InsertInto(buckets_[b], key, value, /*overwrite=*/true);
    }
    if (added && size_.fetch_add(1, std::memory_order_relaxed) + 1 > kMaxLoad * BucketCount()) {
      Grow();
    }
    return added;
  }

  // Removes the key; true if it was there.
  bool erase(const K& key) {
    const size_t h = Hash{}(key);
    ReaderLock r(&resize_mu_);
    const size_t b = h & (buckets_.size() - 1);
    WriterLock l(&stripes_[b % kStripes]);
    if (!buckets_[b]) return false;
    bool removed = false;
    bool now_empty = false;
    {
      DerefScope s;
      std::span<std::byte> bytes = buckets_[b].deref_mut(s);
      Header hd = ReadHeader(bytes);
      for (uint32_t i = 0; i < hd.count; ++i) {
        if (!Eq{}(ReadItem(bytes, i).key, key)) continue;
        if (i + 1 != hd.count) WriteItem(bytes, i, ReadItem(bytes, hd.count - 1));
        --hd.count;
        WriteHeader(bytes, hd);
        removed = true;
        now_empty = hd.count == 0;
        break;
      }
    }
    if (now_empty) buckets_[b].reset();  // give the object back
    if (removed) size_.fetch_sub(1, std::memory_order_relaxed);
    return removed;
  }

 private:
  struct Header {
    uint32_t count;
    uint32_t capacity;
  };
  struct Item {
    K key;
    V value;
  };
  static constexpr uint32_t kInitialCapacity = 4;

  static Header ReadHeader(std::span<const std::byte> b) {
    Header h;
    std::memcpy(&h, b.data(), sizeof(h));
    return h;
  }
  static void WriteHeader(std::span<std::byte> b, const Header& h) {
    std::memcpy(b.data(), &h, sizeof(h));
  }
  static Item ReadItem(std::span<const std::byte> b, uint32_t i) {
    Item it;
    std::memcpy(&it, b.data() + sizeof(Header) + i * sizeof(Item), sizeof(Item));
    return it;
  }
  static void WriteItem(std::span<std::byte> b, uint32_t i, const Item& it) {
    std::memcpy(b.data() + sizeof(Header) + i * sizeof(Item), &it, sizeof(Item));
  }
  static size_t BytesFor(uint32_t capacity) { return sizeof(Header) + capacity * sizeof(Item); }

  size_t BucketCount() const {
    ReaderLock r(&resize_mu_);
    return buckets_.size();
  }

  // The bucket's lock (or the resize lock) is held exclusively.
  bool InsertInto(far_bytes& bucket, const K& key, const V& value, bool overwrite) {
    DerefScope s;
    if (!bucket) {
      bucket = make_far_bytes_in(*rt_, BytesFor(kInitialCapacity));
      std::span<std::byte> bytes = bucket.deref_mut(s);
      WriteHeader(bytes, {0, kInitialCapacity});
    }
    std::span<std::byte> bytes = bucket.deref_mut(s);
    Header hd = ReadHeader(bytes);
    if (overwrite) {
      for (uint32_t i = 0; i < hd.count; ++i) {
        Item it = ReadItem(bytes, i);
        if (Eq{}(it.key, key)) {
          it.value = value;
          WriteItem(bytes, i, it);
          return false;
        }
      }
    }
    if (hd.count == hd.capacity) {
      const uint32_t cap = hd.capacity * 2;
      far_bytes bigger = make_far_bytes_in(*rt_, BytesFor(cap));
      std::span<std::byte> nb = bigger.deref_mut(s);
      std::memcpy(nb.data(), bytes.data(), BytesFor(hd.count));
      hd.capacity = cap;
      bucket = std::move(bigger);  // frees the old object
      bytes = nb;
    }
    WriteItem(bytes, hd.count, Item{key, value});
    ++hd.count;
    WriteHeader(bytes, hd);
    return true;
  }

  void Grow() {
    WriterLock r(&resize_mu_);
    if (size_.load(std::memory_order_relaxed) <= kMaxLoad * buckets_.size()) return;
    std::vector<far_bytes> next(buckets_.size() * 2);
    const size_t mask = next.size() - 1;
    for (far_bytes& old : buckets_) {
      if (!old) continue;
      std::vector<Item> items;
      {
        DerefScope s;
        std::span<const std::byte> bytes = old.deref(s);
        const Header hd = ReadHeader(bytes);
        items.reserve(hd.count);
        for (uint32_t i = 0; i < hd.count; ++i) items.push_back(ReadItem(bytes, i));
      }
      old.reset();
      for (const Item& it : items) {
        InsertInto(next[Hash{}(it.key) & mask], it.key, it.value, /*overwrite=*/false);
      }
    }
    buckets_.swap(next);
  }

  Runtime* rt_;
  mutable SharedMutex resize_mu_;
  // Bucket b's contents are guarded by stripes_[b % kStripes] (with resize_mu_ shared), which
  // the analysis cannot express per element: it checks the directory against resize_mu_ only.
  std::unique_ptr<SharedMutex[]> stripes_;
  std::vector<far_bytes> buckets_ GUARDED_BY(resize_mu_);  // size is a power of two
  std::atomic<size_t> size_{0};
};

}  // namespace farmem
