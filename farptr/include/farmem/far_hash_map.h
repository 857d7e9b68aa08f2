// far_hash_map<K, V>: a hash map whose entries live in far memory, usable with a local budget far
// below its size, shaped like std::unordered_map where that is sound for a concurrent map whose
// entries may be on another machine.
//
//   farmem::far_hash_map<uint64_t, Order> m(*rt);
//   auto [it, inserted] = m.insert(7, order);    // does not overwrite, as std::
//   m.insert_or_assign(7, newer);
//   m[7] = newer;  m[word] += 1;                 // proxies: a write, an atomic read-modify-write
//   std::optional<Order> o = m.find(7);          // values by copy
//   for (auto [k, v] : m) ...                    // iteration by copy, bucket by bucket
//
// Layout: a local directory of buckets (one far_bytes pointer, 8 bytes, per bucket; about one
// byte of local memory per entry at the default load) and, per bucket, one far object holding
// its entries inline: {count, capacity, (K, V) x capacity}. A lookup is one hash, one deref of one
// small object (local: a few instructions; remote: one span swap-in) and a short linear scan.
// A bucket that fills up is reallocated at twice the capacity; the directory doubles when the
// average bucket passes kMaxLoad entries (a full rehash, under an exclusive lock).
//
// Values are returned by copy, so nothing a caller holds points into far memory: find returns
// std::optional<V>, an iterator holds a copy of its bucket's entries and `*it` is a
// std::pair<const K, V> by value (docs/farptr.md lists every difference from std::).
//
// Threads: every method may be called from any thread concurrently (except moves, swap and
// destruction, as with any object). Buckets are guarded by striped reader/writer locks (find and
// iteration share, writes exclude); a directory resize excludes everyone. Locks are taken before
// the internal DerefScope is entered, and a bucket's stripe is not held across a read of that
// bucket from far memory (it is read holding no lock, then looked at again: AtBucket, get_many),
// so a thread waits for another's lookup or write, not for its round trip (except for a bucket
// that left again after 3 reads, then read under its lock, and a directory resize, which reads
// every bucket under the exclusive lock). Iteration concurrent with
// writers is weakly consistent: each entry present for the whole iteration is seen exactly once
// (also across directory growth: buckets are visited in reverse-binary order, Redis SCAN's cursor),
// entries inserted or erased meanwhile may or may not be.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <initializer_list>
#include <iterator>
#include <memory>
#include <optional>
#include <span>
#include <type_traits>
#include <utility>
#include <vector>

#include "farmem/common/mutex.h"
#include "farmem/far_ptr.h"

namespace farmem {

template <typename K, typename V, typename Hash = std::hash<K>, typename Eq = std::equal_to<K>>
class far_hash_map {
  static_assert(std::is_trivially_copyable_v<K> && std::is_trivially_copyable_v<V>,
                "far_hash_map keys and values must be trivially copyable");
  static_assert(sizeof(size_t) == 8, "the iteration cursor assumes 64-bit size_t");

 public:
  static constexpr size_t kMaxLoad = 8;  // average entries per bucket before the directory grows
  static constexpr size_t kStripes = 256;

  using key_type = K;
  using mapped_type = V;
  using value_type = std::pair<const K, V>;
  using size_type = size_t;
  using difference_type = std::ptrdiff_t;
  using hasher = Hash;
  using key_equal = Eq;

  // Iteration over a snapshot of one bucket at a time: `*it` is a copy of the entry, taken when
  // the iterator reached its bucket. A forward iterator (std::forward_iterator); its legacy
  // category is input because `reference` is a value, not a `value_type&`. Never invalidated:
  // the map may change under it (the copy is what it shows); it must not outlive the map.
  class const_iterator {
    struct arrow_proxy {
      value_type entry;
      const value_type* operator->() const { return &entry; }
    };

   public:
    using iterator_concept = std::forward_iterator_tag;
    using iterator_category = std::input_iterator_tag;
    using value_type = far_hash_map::value_type;
    using difference_type = std::ptrdiff_t;
    using reference = value_type;  // by copy
    using pointer = void;

    const_iterator() = default;
    reference operator*() const { return (*items_)[pos_]; }
    arrow_proxy operator->() const { return arrow_proxy{(*items_)[pos_]}; }
    const_iterator& operator++() {
      if (++pos_ >= items_->size()) m_->Seek(*this, NextCursor(cursor_, mask_));
      return *this;
    }
    const_iterator operator++(int) {
      const_iterator t = *this;
      ++*this;
      return t;
    }
    // Positions compare: (bucket, place in the bucket's copy); every end() is equal.
    friend bool operator==(const const_iterator& a, const const_iterator& b) {
      if (a.items_ == nullptr || b.items_ == nullptr) return a.items_ == b.items_;
      return a.cursor_ == b.cursor_ && a.pos_ == b.pos_;
    }

   private:
    friend class far_hash_map;
    const far_hash_map* m_ = nullptr;
    size_t cursor_ = 0;  // the bucket's index
    size_t mask_ = 0;    // the directory's size - 1 when the bucket was copied
    std::shared_ptr<const std::vector<value_type>> items_;  // its entries; null: end()
    size_t pos_ = 0;
  };
  using iterator = const_iterator;  // entries are not modified through iterators (as std::set)

  // What operator[] returns: stands for the value under one key. Nothing happens until it is
  // read or written: reading gives the value, or V{} if the key is absent (without inserting
  // it); assigning is insert_or_assign; += -= ++ -- are one atomic update().
  class mapped_reference {
   public:
    operator V() const { return m_->find(key_).value_or(V{}); }  // NOLINT
    V get() const { return *this; }
    const mapped_reference& operator=(const V& v) const {
      m_->update(key_, [&](V& x) { x = v; });
      return *this;
    }
    const mapped_reference& operator=(const mapped_reference& o) const { return *this = o.get(); }
    template <typename U>
    const mapped_reference& operator+=(const U& d) const requires requires(V& x) {
      x += d;
    }
    {
      m_->update(key_, [&](V& x) { x += d; });
      return *this;
    }
    template <typename U>
    const mapped_reference& operator-=(const U& d) const requires requires(V& x) {
      x -= d;
    }
    {
      m_->update(key_, [&](V& x) { x -= d; });
      return *this;
    }
    const mapped_reference& operator++() const requires requires(V& x) { ++x; }
    {
      m_->update(key_, [](V& x) { ++x; });
      return *this;
    }
    const mapped_reference& operator--() const requires requires(V& x) { --x; }
    {
      m_->update(key_, [](V& x) { --x; });
      return *this;
    }

   private:
    friend class far_hash_map;
    mapped_reference(far_hash_map* m, const K& key) : m_(m), key_(key) {}
    mapped_reference(const mapped_reference&) = default;
    far_hash_map* m_;
    K key_;
  };

  explicit far_hash_map(Runtime& rt, size_t expected_size = 0)
      : rt_(&rt), stripes_(std::make_unique<SharedMutex[]>(kStripes)) {
    buckets_.resize(BucketsFor(expected_size));
  }
  far_hash_map(Runtime& rt, std::initializer_list<value_type> init)
      : far_hash_map(rt, init.size()) {
    for (const value_type& e : init) insert(e);
  }
  // Copying would duplicate far data behind the caller's back: copy explicitly, entry by entry.
  far_hash_map(const far_hash_map&) = delete;
  far_hash_map& operator=(const far_hash_map&) = delete;
  // Moves take the buckets; the moved-from map is empty and stays usable. Not concurrent with
  // other calls on either map.
  far_hash_map(far_hash_map&& o) : rt_(o.rt_), stripes_(std::make_unique<SharedMutex[]>(kStripes)) {
    buckets_ = o.TakeBuckets(&size_);
  }
  far_hash_map& operator=(far_hash_map&& o) {
    if (this == &o) return *this;
    std::atomic<size_t> n{0};
    std::vector<far_bytes> taken = o.TakeBuckets(&n);
    {
      WriterLock r(&resize_mu_);
      buckets_.swap(taken);
      size_.store(n.load(std::memory_order_relaxed), std::memory_order_relaxed);
      rt_ = o.rt_;
    }
    return *this;  // `taken` (our old buckets) is freed here, outside the lock
  }

  Runtime& runtime() const { return *rt_; }
  size_t size() const { return size_.load(std::memory_order_relaxed); }
  bool empty() const { return size() == 0; }
  size_t bucket_count() const { return BucketCount(); }

  // --- Lookup. ---
  // Lookup: by copy. A bucket that is not local is read holding no lock of the map, as
  // get_many reads (AtBucket): another thread wanting its stripe does not wait for the round trip.
  std::optional<V> find(const K& key) const {
    const size_t h = Hash{}(key);
    return AtBucket<ReaderLock>(
        this, [h](size_t mask) { return h & mask; },
        [&](const far_bytes& bucket, size_t, size_t, const DerefScope& s) {
          return Lookup(bucket, key, s);
        });
  }
  // Batched lookup: out[i] = find(keys[i]) for every i < min(keys.size(), out.size()), with the
  // misses overlapped: the buckets that are not local are read together, one round trip for up
  // to 32 of them (farmem::farptr_internal::FetchObjects), where that many finds would wait for
  // one read after another. For a program that has several independent lookups at hand (a batch
  // of requests). No lock is held across the reads: the buckets' stripes are read-locked (in
  // index order) to answer the keys whose buckets are local and to note the others, released for
  // the reads, and taken again to answer those, now local; a bucket that changed meanwhile is
  // simply looked at again (what it holds then is the answer), and one still not local after
  // kFetchRounds reads is read under its lock (as every single-key operation does: AtBucket). So
  // a writer to one of the batch's
  // buckets waits for a lookup, never for a round trip, and each out[i] is what find(keys[i])
  // returned at some moment during the call (the batch is not one snapshot of the map). A batch
  // of more than kBatchKeys (32) keys is taken 32 at a time.
  void get_many(std::span<const K> keys, std::span<std::optional<V>> out) const {
    const size_t n = std::min(keys.size(), out.size());
    for (size_t at = 0; at < n; at += kBatchKeys) {
      const size_t len = std::min(kBatchKeys, n - at);
      GetBatch(keys.subspan(at, len), out.subspan(at, len));
    }
  }
  // Brings the buckets of `keys` local now, their misses overlapped as in get_many (no lock held
  // across the reads), for the operations on those keys that follow (update, find, insert...)
  // to hit. Nothing is pinned: under memory pressure a bucket may leave again before it is used
  // (it starts hot).
  void prefetch(std::span<const K> keys) const {
    std::vector<farptr_internal::ObjectEntry*> misses;
    for (size_t at = 0; at < keys.size(); at += kBatchKeys) {
      std::vector<size_t> some(std::min(kBatchKeys, keys.size() - at));
      for (size_t i = 0; i < some.size(); ++i) some[i] = at + i;
      ReaderLock r(&resize_mu_);
      const size_t mask = buckets_.size() - 1;
      StripeSet stripes(this, keys, some, mask);
      for (size_t i : some) {
        const far_bytes& bucket = buckets_[Hash{}(keys[i]) & mask];
        if (bucket && !Ready(bucket)) misses.push_back(bucket.entry());
      }
    }
    Fetch(misses);
  }
  bool contains(const K& key) const { return find(key).has_value(); }
  size_t count(const K& key) const { return contains(key) ? 1 : 0; }

  // --- Insertion. Each returns {an iterator at the key's entry, whether it was inserted}. ---
  // Inserts unless the key is there (then nothing changes).
  std::pair<iterator, bool> insert(const K& key, const V& value) {
    return Upsert(
        key, [&] { return value; }, [](V&) { return false; }, /*want_iterator=*/true);
  }
  std::pair<iterator, bool> insert(const value_type& entry) {
    return insert(entry.first, entry.second);
  }
  // Inserts, or overwrites the key's value.
  std::pair<iterator, bool> insert_or_assign(const K& key, const V& value) {
    return Upsert(
        key, [&] { return value; },
        [&](V& v) {
          v = value;
          return true;
        },
        true);
  }
  // Inserts V(args...) unless the key is there (then args are not used).
  template <typename... Args>
  std::pair<iterator, bool> try_emplace(const K& key, Args&&... args) {
    return Upsert(
        key, [&] { return V(std::forward<Args>(args)...); }, [](V&) { return false; }, true);
  }
  template <typename... Args>
  std::pair<iterator, bool> emplace(const K& key, Args&&... args) {
    return try_emplace(key, std::forward<Args>(args)...);
  }

  // Atomic read-modify-write: calls f(V&) on the key's value — on V{} first inserted if the key
  // is absent — under the bucket's write lock; true if the key was inserted. `f` runs inside a
  // DerefScope holding a lock: it must be short and must not call into this map.
  template <typename F>
  bool update(const K& key, F&& f) {
    return Upsert(
               key,
               [&] {
                 V v{};
                 f(v);
                 return v;
               },
               [&](V& v) {
                 f(v);
                 return true;
               },
               /*want_iterator=*/false)
        .second;
  }
  // m[key] = v; m[key] += d; V x = m[key]; (see mapped_reference). No const version: use find.
  mapped_reference operator[](const K& key) { return mapped_reference(this, key); }

  // --- Removal. ---
  // Removes the key; the number of entries removed (0 or 1). Its bucket is brought local first
  // holding no lock (AtBucket), then changed under its stripe's write lock.
  size_t erase(const K& key) {
    const size_t h = Hash{}(key);
    const bool removed = AtBucket<WriterLock>(
        this, [h](size_t mask) { return h & mask; },
        [&](far_bytes& bucket, size_t, size_t, const DerefScope& s) {
          if (!bucket) return false;
          std::span<std::byte> bytes = bucket.deref_mut(s);
          Header hd = ReadHeader(bytes);
          for (uint32_t i = 0; i < hd.count; ++i) {
            if (!Eq{}(ReadItem(bytes, i).key, key)) continue;
            if (i + 1 != hd.count) WriteItem(bytes, i, ReadItem(bytes, hd.count - 1));
            --hd.count;
            WriteHeader(bytes, hd);
            if (hd.count == 0) bucket.reset();  // give the object back (as Append's growth does)
            return true;
          }
          return false;
        });
    if (removed) size_.fetch_sub(1, std::memory_order_relaxed);
    return removed ? 1 : 0;
  }
  // Removes the entry `pos` shows (by its key); the iterator past it.
  iterator erase(const_iterator pos) {
    const K key = pos->first;
    ++pos;
    erase(key);
    return pos;
  }
  // Frees every bucket; the directory keeps its size (as std::'s bucket_count()).
  void clear() {
    std::vector<far_bytes> old;
    {
      WriterLock r(&resize_mu_);
      old.resize(buckets_.size());
      buckets_.swap(old);
      size_.store(0, std::memory_order_relaxed);
    }
  }
  // Sizes the directory for `n` entries now (one rehash) instead of doubling on the way.
  void reserve(size_t n) { Rehash(BucketsFor(n)); }

  // --- Iteration. ---
  const_iterator begin() const {
    const_iterator it;
    it.m_ = this;
    Seek(it, 0);
    return it;
  }
  const_iterator end() const {
    const_iterator it;
    it.m_ = this;
    return it;
  }
  const_iterator cbegin() const { return begin(); }
  const_iterator cend() const { return end(); }

  // Removes every entry for which pred(const value_type&) holds; how many were removed.
  template <typename Pred>
  friend size_t erase_if(far_hash_map& m, Pred pred) {
    size_t n = 0;
    for (auto it = m.begin(); it != m.end();) {
      if (pred(*it)) {
        it = m.erase(it);
        ++n;
      } else {
        ++it;
      }
    }
    return n;
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
  // get_many and AtBucket: rounds of reads holding no lock, each followed by a look under the
  // locks, before a bucket still not local is read under its lock (a bucket changed, evicted
  // again, or busy each time).
  static constexpr int kFetchRounds = 3;
  // get_many and prefetch take the stripes of at most this many keys at once (a larger batch is
  // looked at in slices): a short hold each time, and few enough locks for ThreadSanitizer's
  // deadlock detector (64 held at once by one thread).
  static constexpr size_t kBatchKeys = 32;

  static size_t BucketsFor(size_t entries) {
    size_t n = 64;
    while (n * kMaxLoad / 2 < entries) n *= 2;
    return n;
  }
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

  // The stripes of the buckets of keys[i] for i in `which`, read-locked in index order (writers
  // hold one stripe at a time, so taking several in order cannot deadlock), for a batch.
  class StripeSet {
   public:
    StripeSet(const far_hash_map* m, std::span<const K> keys, std::span<const size_t> which,
              size_t mask) NO_THREAD_SAFETY_ANALYSIS : m_(m) {
      held_.reserve(which.size());
      for (size_t i : which) {
        held_.push_back(static_cast<uint32_t>((Hash{}(keys[i]) & mask) % kStripes));
      }
      std::sort(held_.begin(), held_.end());
      held_.erase(std::unique(held_.begin(), held_.end()), held_.end());
      for (uint32_t i : held_) m_->stripes_[i].LockShared();
    }
    ~StripeSet() NO_THREAD_SAFETY_ANALYSIS {
      for (uint32_t i : held_) m_->stripes_[i].UnlockShared();
    }
    StripeSet(const StripeSet&) = delete;
    StripeSet& operator=(const StripeSet&) = delete;

   private:
    const far_hash_map* m_;
    std::vector<uint32_t> held_;
  };
  // get_many for at most kBatchKeys keys (so at most that many stripes are held at once).
  void GetBatch(std::span<const K> keys, std::span<std::optional<V>> out) const {
    std::vector<size_t> todo(keys.size());
    for (size_t i = 0; i < todo.size(); ++i) todo[i] = i;
    std::vector<farptr_internal::ObjectEntry*> misses;
    for (int round = 0; !todo.empty(); ++round) {
      const bool read_under_lock = round == kFetchRounds;
      misses.clear();
      {
        ReaderLock r(&resize_mu_);
        const size_t mask = buckets_.size() - 1;
        StripeSet stripes(this, keys, todo, mask);
        DerefScope s;
        size_t left = 0;
        for (size_t i : todo) {
          const far_bytes& bucket = buckets_[Hash{}(keys[i]) & mask];
          if (bucket && !Ready(bucket) && !read_under_lock) {
            misses.push_back(bucket.entry());
            todo[left++] = i;
          } else {
            out[i] = Lookup(bucket, keys[i], s);  // local (or the last round): no lock waits long
          }
        }
        todo.resize(left);
      }
      Fetch(misses);
    }
  }

  // Reads the bucket objects `misses` names together (get_many, prefetch, AtBucket), holding no
  // lock of the map: the buckets may change meanwhile (FetchObjects skips entries freed or reused
  // since), so the caller looks again, under the stripes, at what it found.
  void Fetch(std::span<farptr_internal::ObjectEntry* const> misses) const {
    if (misses.empty()) return;
    DerefScope s;  // entered holding no lock (the budget gate may wait here)
    farptr_internal::FetchObjects(rt_, misses);
  }
  // Whether `bucket`'s deref, in a scope entered before this, needs no I/O and waits for no one:
  // present and not being moved (one being moved may be in a write-out, which a deref waits for).
  static bool Ready(const far_bytes& bucket) {
    const uint64_t w = farptr_internal::LoadWord(bucket.entry());
    return (w & (farptr_internal::kPresent | farptr_internal::kEvacuating)) ==
           farptr_internal::kPresent;
  }
  // Where the single-key operations (find, insert*, try_emplace, update, erase) and iteration
  // meet their bucket: calls use(bucket, b, mask, s) on bucket b = pick(mask) of the directory
  // (mask: its size - 1), with the resize lock shared, b's stripe locked (Lock: ReaderLock or
  // WriterLock) and a DerefScope s entered after them, once the bucket is local (or empty). A
  // bucket that is not local is noted, every lock released, the bucket read as get_many reads
  // (Fetch), and the whole looked at again: b is picked anew (the directory may have doubled) and
  // what it holds then is what `use` sees; after kFetchRounds such reads (the bucket changed or
  // left again each time) it is read under the locks. So a thread wanting the stripe waits for a
  // lookup or a write, not for this one's round trip, and every decision on the bucket is still
  // taken under its stripe lock (writers stay linearizable per key). `m` is this map (const for
  // find and iteration); what `use` returns.
  template <typename Lock, typename Map, typename Pick, typename Use>
  static auto AtBucket(Map* m, Pick&& pick, Use&& use) {
    for (int round = 0;; ++round) {
      farptr_internal::ObjectEntry* miss = nullptr;
      {
        ReaderLock r(&m->resize_mu_);
        const size_t mask = m->buckets_.size() - 1;
        const size_t b = pick(mask);
        Lock l(&m->stripes_[b % kStripes]);
        auto& bucket = m->buckets_[b];
        const bool last = round == kFetchRounds;
        // A miss is noted before any scope is entered: entering one may wait at the budget gate
        // (a reclaim), and the miss enters two more (its read, its second look). The bucket is
        // checked again in the scope, whose entry may have evicted it.
        if (last || !bucket || Ready(bucket)) {
          DerefScope s;
          if (last || !bucket || Ready(bucket)) return use(bucket, b, mask, s);
        }
        miss = bucket.entry();
      }
      m->Fetch({&miss, 1});
    }
  }

  // The value under `key` in `bucket` (null: none). Its stripe is held.
  static std::optional<V> Lookup(const far_bytes& bucket, const K& key, const DerefScope& s) {
    if (!bucket) return std::nullopt;
    std::span<const std::byte> bytes = bucket.deref(s);
    const Header hd = ReadHeader(bytes);
    for (uint32_t i = 0; i < hd.count; ++i) {
      Item it = ReadItem(bytes, i);
      if (Eq{}(it.key, key)) return it.value;
    }
    return std::nullopt;
  }

  size_t BucketCount() const {
    ReaderLock r(&resize_mu_);
    return buckets_.size();
  }

  // The bucket visited after bucket `v` in a directory of mask + 1 buckets; 0 once all were.
  // Reverse-binary order (Redis's dictScan): when the directory doubles, the buckets already
  // visited are exactly those whose entries went to buckets also already visited, so an iterator
  // that takes its next cursor from the mask its bucket was copied under neither repeats nor
  // misses entries across growth.
  static size_t NextCursor(size_t v, size_t mask) {
    v |= ~mask;
    v = Reverse(v);
    ++v;
    return Reverse(v);
  }
  static size_t Reverse(size_t v) {
    v = ((v >> 1) & 0x5555555555555555ull) | ((v & 0x5555555555555555ull) << 1);
    v = ((v >> 2) & 0x3333333333333333ull) | ((v & 0x3333333333333333ull) << 2);
    v = ((v >> 4) & 0x0f0f0f0f0f0f0f0full) | ((v & 0x0f0f0f0f0f0f0f0full) << 4);
    v = ((v >> 8) & 0x00ff00ff00ff00ffull) | ((v & 0x00ff00ff00ff00ffull) << 8);
    v = ((v >> 16) & 0x0000ffff0000ffffull) | ((v & 0x0000ffff0000ffffull) << 16);
    return (v >> 32) | (v << 32);
  }

  static std::shared_ptr<const std::vector<value_type>> CopyEntries(
      std::span<const std::byte> bytes) {
    const Header hd = ReadHeader(bytes);
    if (hd.count == 0) return nullptr;
    auto items = std::make_shared<std::vector<value_type>>();
    items->reserve(hd.count);
    for (uint32_t i = 0; i < hd.count; ++i) {
      const Item it = ReadItem(bytes, i);
      items->emplace_back(it.key, it.value);
    }
    return items;
  }

  // Points `it` at the first entry of the first non-empty bucket from cursor `v` on (v == 0
  // after the first bucket means the scan wrapped: end()). Each bucket is copied under its own
  // look (AtBucket: a remote one is read holding no lock), so the directory may double between
  // two of them, as between two increments: the cursor order is made for that.
  void Seek(const_iterator& it, size_t v) const {
    const bool from_start = it.items_ == nullptr && v == 0;
    for (bool first = true;; first = false) {
      if (v == 0 && !(first && from_start)) {
        it.items_.reset();
        it.cursor_ = it.pos_ = 0;
        return;
      }
      size_t mask = 0;
      std::shared_ptr<const std::vector<value_type>> items = AtBucket<ReaderLock>(
          this,
          [&](size_t m) {
            mask = m;
            return v & m;
          },
          [](const far_bytes& bucket, size_t, size_t,
             const DerefScope& s) -> std::shared_ptr<const std::vector<value_type>> {
            return bucket ? CopyEntries(bucket.deref(s)) : nullptr;
          });
      if (items) {
        it.items_ = std::move(items);
        it.cursor_ = v & mask;
        it.mask_ = mask;
        it.pos_ = 0;
        return;
      }
      v = NextCursor(v, mask);
    }
  }

  // The one write path. Looks `key` up in its bucket; if absent, appends {key, make()}; if
  // present, calls change(V&) on a copy of its value and writes it back if that returns true.
  // Returns whether the key was inserted and, if asked for, an iterator at its entry. The bucket
  // is brought local holding no lock (AtBucket); all of this runs under its stripe's write lock.
  template <typename Make, typename Change>
  std::pair<iterator, bool> Upsert(const K& key, Make&& make, Change&& change, bool want_iterator) {
    const size_t h = Hash{}(key);
    auto [it, added] = AtBucket<WriterLock>(
        this, [h](size_t mask) { return h & mask; },
        [&](far_bytes& bucket, size_t b, size_t mask, const DerefScope& s) {
          iterator pos;
          bool inserted = false;
          uint32_t at = UINT32_MAX;
          if (bucket) {
            std::span<const std::byte> bytes = std::as_const(bucket).deref(s);  // no dirtying yet
            const Header hd = ReadHeader(bytes);
            for (uint32_t i = 0; i < hd.count && at == UINT32_MAX; ++i) {
              if (Eq{}(ReadItem(bytes, i).key, key)) at = i;
            }
            if (at != UINT32_MAX) {
              Item item = ReadItem(bytes, at);
              if (change(item.value)) WriteItem(bucket.deref_mut(s), at, item);
            }
          }
          if (at == UINT32_MAX) {
            at = Append(bucket, Item{key, make()}, s);
            inserted = true;
          }
          if (want_iterator) {
            pos.m_ = this;
            pos.cursor_ = b;
            pos.mask_ = mask;
            pos.items_ = CopyEntries(std::as_const(bucket).deref(s));
            pos.pos_ = at;
          }
          return std::pair<iterator, bool>(std::move(pos), inserted);
        });
    if (added && size_.fetch_add(1, std::memory_order_relaxed) + 1 > kMaxLoad * BucketCount()) {
      Rehash(0);
    }
    return {std::move(it), added};
  }

  // Appends an entry whose key is not in the bucket; its index. The bucket's lock (or the resize
  // lock) is held exclusively.
  uint32_t Append(far_bytes& bucket, const Item& item, const DerefScope& s) {
    if (!bucket) {
      bucket = make_far_bytes_in(*rt_, BytesFor(kInitialCapacity));
      WriteHeader(bucket.deref_mut(s), {0, kInitialCapacity});
    }
    std::span<std::byte> bytes = bucket.deref_mut(s);
    Header hd = ReadHeader(bytes);
    if (hd.count == hd.capacity) {
      const uint32_t cap = hd.capacity * 2;
      far_bytes bigger = make_far_bytes_in(*rt_, BytesFor(cap));
      std::span<std::byte> nb = bigger.deref_mut(s);
      std::memcpy(nb.data(), bytes.data(), BytesFor(hd.count));
      hd.capacity = cap;
      bucket = std::move(bigger);  // frees the old object
      bytes = nb;
    }
    WriteItem(bytes, hd.count, item);
    ++hd.count;
    WriteHeader(bytes, hd);
    return hd.count - 1;
  }

  // Doubles the directory while the load passes kMaxLoad, and to at least `min_buckets`.
  void Rehash(size_t min_buckets) {
    WriterLock r(&resize_mu_);
    size_t n = buckets_.size();
    while (n < min_buckets || size_.load(std::memory_order_relaxed) > kMaxLoad * n) n *= 2;
    if (n == buckets_.size()) return;
    std::vector<far_bytes> next(n);
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
        DerefScope s;
        Append(next[Hash{}(it.key) & mask], it, s);
      }
    }
    buckets_.swap(next);
  }

  // For moves: hands over the buckets and the entry count, leaving an empty directory.
  std::vector<far_bytes> TakeBuckets(std::atomic<size_t>* n) {
    WriterLock r(&resize_mu_);
    std::vector<far_bytes> taken(BucketsFor(0));
    taken.swap(buckets_);
    n->store(size_.exchange(0, std::memory_order_relaxed), std::memory_order_relaxed);
    return taken;
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
