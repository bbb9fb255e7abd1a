#pragma once
// BlockStore: fixed-size blocks of cache memory, committed when first used and shared by
// reference count. A cache keeps its packed rows (and the rows of unquantized tensors) in blocks
// of one layer and a fixed number of tokens; caches that fork share the blocks they have in
// common. Blocks are only ever written by a cache that holds the sole reference (a shared block
// is copied first), so sharing never changes what another cache reads.
//
// Memory comes in slabs of about 2 MiB (several blocks, or one larger block), 2 MiB-aligned and
// advised as huge pages (AlignedBuffer): attention streams every block each step, and one core
// reads a third faster from huge pages. A store commits at most one slab more than its peak use.
//
// A store's limit may also count memory kept outside it: a KVPool's budget covers each sequence's
// own rows (sinks, window ring, rollback copies, scratch), charged in whole blocks while the
// sequence lives. The limit bounds blocks in use plus charges. Freed blocks stay committed for
// reuse (counts().committed) until charges need the room: a charge gives back slabs with no block
// in use while committed blocks and charges exceed the limit, and so does a release that empties a
// slab while they exceed it by a slab or more (by less, the slab is kept: a slab committed at the
// limit would otherwise be given back and committed again at every block). The lowest free block
// is handed out first, so use gathers in the first slabs and the last ones empty. What can stand
// above the limit is less than a slab, and the free blocks of slabs that hold a block in use.
//
// Appends, truncates, erases and loads reserve every block they take (BlockReservation) before
// they take the first, so they are refused before they copy or write anything; a pool load
// reserves its sequences' own rows with the blocks and turns them into charges.
//
// Thread safety: every member may be called from any thread; data() of a block the caller holds
// needs no lock (its slot changes only while no cache holds the block).

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <new>
#include <string>
#include <utility>
#include <vector>

#include "kvq/core/aligned_buffer.hpp"
#include "kvq/error.hpp"

namespace kvq::inline v0 {

using BlockId = std::uint32_t;

struct BlockCounts {
  std::size_t committed = 0;  // blocks whose memory is allocated (in use, or free in a slab)
  std::size_t in_use = 0;     // blocks some cache refers to
  std::size_t shared = 0;     // blocks more than one cache refers to
  std::size_t charged = 0;    // blocks of the limit held for caches' own rows (StoreLimit)
};

/// What a store's limit counts: its blocks (a cache's own store, sized for its capacity), or its
/// blocks and the own rows of every cache over it in whole blocks (a KVPool's memory budget).
enum class StoreLimit { blocks, blocks_and_own_rows };

class BlockReservation;

class BlockStore {
 public:
  /// Most blocks one store hands out: ids are 32-bit.
  static constexpr std::size_t max_blocks_limit = std::size_t(1) << 31;
  /// Largest block: rounding it up to whole cache lines must not wrap.
  static constexpr std::size_t max_block_bytes = std::size_t(1) << 40;

  BlockStore(std::size_t block_bytes, std::size_t max_blocks, StoreLimit limit = StoreLimit::blocks)
      : block_bytes_((std::min(block_bytes, max_block_bytes) + 63) / 64 * 64), max_blocks_(max_blocks), limit_(limit) {
    if (block_bytes == 0 || block_bytes > max_block_bytes || max_blocks == 0 || max_blocks > max_blocks_limit)
      throw Error(ErrorCode::invalid_argument, "block store: " + std::to_string(max_blocks) + " blocks of " +
                                                   std::to_string(block_bytes) + " bytes (need at least one block of " +
                                                   "1 byte to 2^40 bytes, and at most 2^31 blocks)");
    try {
      slots_ = std::make_unique<Slot[]>(max_blocks);
    } catch (const std::bad_alloc&) {
      throw Error(ErrorCode::out_of_memory, "block store: a table of " + std::to_string(max_blocks) + " blocks");
    }
    slab_blocks_ = (AlignedBuffer::huge_page + block_bytes_ - 1) / block_bytes_;
  }
  BlockStore(const BlockStore&) = delete;
  BlockStore& operator=(const BlockStore&) = delete;

  /// Bytes of the table a store of max_blocks allocates up front (its blocks come in slabs).
  static std::size_t table_bytes(std::size_t max_blocks) noexcept { return max_blocks * sizeof(Slot); }

  std::size_t block_bytes() const noexcept { return block_bytes_; }
  std::size_t max_blocks() const noexcept { return max_blocks_; }
  StoreLimit limit() const noexcept { return limit_; }
  /// Whole blocks that `bytes` take of the limit.
  std::size_t blocks_holding(std::size_t bytes) const noexcept {
    return bytes / block_bytes_ + (bytes % block_bytes_ != 0);
  }

  /// A zeroed block with one reference. Throws kvq::Error (capacity_exceeded) when every block of
  /// the limit is in use, charged or reserved, naming `what` needed it; out_of_memory when the system
  /// refuses the memory.
  BlockId acquire(const char* what = "a cache") {
    std::lock_guard lock(mutex_);
    if (unclaimed() == 0)
      throw Error(ErrorCode::capacity_exceeded,
                  std::string(what) + " needs another block, but all " + std::to_string(max_blocks_) + " blocks of " +
                      std::to_string(block_bytes_) + " bytes are in use" +
                      (charged_ == 0 ? "" : " (" + std::to_string(charged_) + " by sequences' own rows)"));
    return take_free_block();
  }

  /// Blocks that acquire() can still hand out.
  std::size_t available() const {
    std::lock_guard lock(mutex_);
    return unclaimed();
  }

  /// Counts n blocks against the limit for memory kept elsewhere (OwnRowsCharge); throws
  /// capacity_exceeded, naming `what`, when fewer are available.
  void charge(std::size_t n, const std::string& what) {
    std::lock_guard lock(mutex_);
    if (const std::size_t free = unclaimed(); n > free)
      throw Error(ErrorCode::capacity_exceeded,
                  what + " take " + std::to_string(n) + " blocks of " + std::to_string(block_bytes_) + " bytes, but " +
                      std::to_string(free) + " of " + std::to_string(max_blocks_) + " are free");
    charged_ += n;
    give_back_free_slabs(max_blocks_);
  }
  void refund(std::size_t n) noexcept {
    std::lock_guard lock(mutex_);
    charged_ -= n;
  }

  void retain(BlockId id) noexcept {
    std::lock_guard lock(mutex_);
    if (slots_[id].refs.fetch_add(1, std::memory_order_relaxed) == 1) ++shared_;
  }
  void release(BlockId id) noexcept {
    std::lock_guard lock(mutex_);
    // Release: a holder that then finds itself alone (shared(), acquire) writes only after what
    // this one read of the block.
    const unsigned before = slots_[id].refs.fetch_sub(1, std::memory_order_release);
    if (before == 2) --shared_;
    if (before == 1) {
      free_.push_back(id);  // room reserved when its slab was committed
      std::push_heap(free_.begin(), free_.end(), std::greater<>());
      --in_use_;
      if (--slabs_[id / slab_blocks_].in_use == 0 && committed_ + charged_ >= max_blocks_ + slab_blocks_)
        give_back_free_slabs(max_blocks_);
    }
  }
  /// How many caches refer to the block.
  unsigned references(BlockId id) const noexcept { return slots_[id].refs.load(std::memory_order_relaxed); }
  /// True when more than one cache refers to the block: it must be copied before a write.
  bool shared(BlockId id) const noexcept { return slots_[id].refs.load(std::memory_order_acquire) > 1; }

  /// Changes whenever the block's bytes may have changed: on acquire, and when its sole holder
  /// is about to write to it (written()). Hashes of a block's bytes stay valid while it holds.
  std::uint64_t version(BlockId id) const noexcept { return slots_[id].version.load(std::memory_order_relaxed); }
  void written(BlockId id) noexcept { slots_[id].version.fetch_add(1, std::memory_order_relaxed); }

  std::uint8_t* data(BlockId id) noexcept { return slots_[id].data.load(std::memory_order_acquire); }
  const std::uint8_t* data(BlockId id) const noexcept { return slots_[id].data.load(std::memory_order_acquire); }

  BlockCounts counts() const {
    std::lock_guard lock(mutex_);
    return {committed_, in_use_, shared_, charged_};
  }

  /// Gives back slabs with no block in use until no more than `committed` blocks are committed:
  /// a failed load returns what it committed, and the blocks kept for reuse stay.
  void give_back_unused(std::size_t committed) noexcept {
    std::lock_guard lock(mutex_);
    give_back_free_slabs(committed + charged_);
  }

 private:
  friend class BlockReservation;

  // Reservations, through BlockReservation: n blocks set aside for acquire_reserved(); false,
  // having set none aside, when fewer are available (then `*free`, if given, says how many were).
  bool reserve(std::size_t n, std::size_t* free = nullptr) noexcept {
    std::lock_guard lock(mutex_);
    if (n > unclaimed()) {
      if (free != nullptr) *free = unclaimed();
      return false;
    }
    reserved_ += n;
    return true;
  }
  void unreserve(std::size_t n) noexcept {
    std::lock_guard lock(mutex_);
    reserved_ -= n;
  }
  // n reserved blocks counted as a charge instead (OwnRowsCharge drawn on a reservation).
  void charge_reserved(std::size_t n) noexcept {
    std::lock_guard lock(mutex_);
    reserved_ -= n;
    charged_ += n;
    give_back_free_slabs(max_blocks_);
  }
  // A reserved block handed out as acquire() hands one out. Throws out_of_memory only, with the
  // reservation unchanged.
  BlockId acquire_reserved() {
    std::lock_guard lock(mutex_);
    const BlockId id = take_free_block();
    --reserved_;
    return id;
  }

  struct Slot {
    std::atomic<std::uint8_t*> data{nullptr};
    std::atomic<unsigned> refs{0};
    std::atomic<std::uint64_t> version{0};
  };
  // Slab s holds blocks [s * slab_blocks_, s * slab_blocks_ + slab_size(s)) while its memory is
  // committed; its ids are free again once it is given back.
  struct Slab {
    AlignedBuffer memory;
    std::size_t in_use = 0;
  };
  // Blocks of the limit not in use, charged or reserved. The caller holds the mutex.
  std::size_t unclaimed() const noexcept { return max_blocks_ - in_use_ - charged_ - reserved_; }
  std::size_t slab_size(std::size_t s) const noexcept { return std::min(slab_blocks_, max_blocks_ - s * slab_blocks_); }
  bool committed(std::size_t s) const noexcept { return slabs_[s].memory.data() != nullptr; }

  // The lowest free block, zeroed, with one reference. The caller holds the mutex and has
  // checked the limit; throws out_of_memory only, having changed nothing.
  BlockId take_free_block() {
    if (free_.empty()) commit_slab();
    std::pop_heap(free_.begin(), free_.end(), std::greater<>());
    const BlockId id = free_.back();
    free_.pop_back();
    std::memset(slots_[id].data.load(std::memory_order_relaxed), 0, block_bytes_);
    slots_[id].refs.store(1, std::memory_order_relaxed);
    slots_[id].version.fetch_add(1, std::memory_order_relaxed);
    ++slabs_[id / slab_blocks_].in_use;
    ++in_use_;
    return id;
  }
  // Commits the first slab that is not: with no block free, committed_ == in_use_ < max_blocks_,
  // so one is not.
  void commit_slab() {
    std::size_t s = given_back_ == 0 ? slabs_.size() : 0;
    while (s < slabs_.size() && committed(s)) ++s;
    const std::size_t n = slab_size(s);
    try {
      free_.reserve(committed_ + n);  // room for every block: release() (noexcept) never allocates
      slabs_.reserve(s + 1);
    } catch (const std::bad_alloc&) {
      throw Error(ErrorCode::out_of_memory, "block store: the table of " + std::to_string(committed_ + n) + " blocks");
    }
    AlignedBuffer memory(n * block_bytes_);  // may throw: nothing changed yet
    if (s == slabs_.size())
      slabs_.emplace_back();
    else
      --given_back_;
    for (std::size_t i = 0; i < n; ++i) {
      slots_[s * slab_blocks_ + i].data.store(memory.data() + i * block_bytes_, std::memory_order_release);
      free_.push_back(BlockId(s * slab_blocks_ + i));
      std::push_heap(free_.begin(), free_.end(), std::greater<>());
    }
    slabs_[s].memory = std::move(memory);
    committed_ += n;
  }
  // While committed blocks and charges exceed `keep` (the limit), gives back slabs with no block
  // in use, the last first (the lowest blocks are handed out first, so the last slabs empty first).
  void give_back_free_slabs(std::size_t keep) noexcept {
    std::size_t given = 0;
    for (std::size_t s = slabs_.size(); s-- > 0 && committed_ + charged_ > keep;) {
      if (!committed(s) || slabs_[s].in_use != 0) continue;
      for (std::size_t i = 0; i < slab_size(s); ++i)
        slots_[s * slab_blocks_ + i].data.store(nullptr, std::memory_order_relaxed);
      slabs_[s].memory = AlignedBuffer();
      committed_ -= slab_size(s);
      ++given;
    }
    if (given == 0) return;
    given_back_ += given;
    std::erase_if(free_, [&](BlockId id) { return !committed(id / slab_blocks_); });
    std::make_heap(free_.begin(), free_.end(), std::greater<>());
  }

  std::size_t block_bytes_, max_blocks_;
  StoreLimit limit_;
  std::unique_ptr<Slot[]> slots_;  // fixed size: readers never see it move
  mutable std::mutex mutex_;
  std::size_t slab_blocks_ = 1;
  std::vector<Slab> slabs_;     // moving a slab keeps its memory
  std::size_t given_back_ = 0;  // slabs whose memory was given back, to commit again first
  std::vector<BlockId> free_;   // a heap, lowest id on top
  std::size_t committed_ = 0, in_use_ = 0, shared_ = 0, charged_ = 0, reserved_ = 0;
};

/// Blocks of a store's limit reserved for one change and handed out one at a time: a change that
/// needs several (copies of shared blocks in every layer) reserves them all before the first, so
/// it is refused before anything changes. What is not taken goes back when the reservation ends.
class BlockReservation {
 public:
  explicit BlockReservation(BlockStore& store) noexcept : store_(&store) {}
  BlockReservation(BlockReservation&& other) noexcept
      : store_(other.store_), blocks_(std::exchange(other.blocks_, 0)) {}
  BlockReservation& operator=(BlockReservation&&) = delete;
  ~BlockReservation() {
    if (blocks_ != 0) store_->unreserve(blocks_);
  }
  /// Reserves n more blocks; false, having reserved none, when fewer are available (then
  /// `*free`, if given, says how many were).
  bool add(std::size_t n, std::size_t* free = nullptr) noexcept {
    if (!store_->reserve(n, free)) return false;
    blocks_ += n;
    return true;
  }
  /// One of the reserved blocks, acquired (zeroed, one reference). Throws kvq::Error:
  /// out_of_memory when the system refuses the memory, capacity_exceeded when none is left.
  BlockId take() {
    if (blocks_ == 0) throw Error(ErrorCode::capacity_exceeded, "a change took more blocks than it reserved");
    const BlockId id = store_->acquire_reserved();
    --blocks_;
    return id;
  }
  std::size_t blocks() const noexcept { return blocks_; }

 private:
  friend class OwnRowsCharge;
  // Turns n of the reserved blocks into a charge of the store (own rows); false, changing
  // nothing, when fewer are reserved or `store` is another store.
  bool charge(const BlockStore& store, std::size_t n) noexcept {
    if (&store != store_ || n > blocks_) return false;
    store_->charge_reserved(n);
    blocks_ -= n;
    return true;
  }

  BlockStore* store_;
  std::size_t blocks_ = 0;
};

/// A cache's own rows counted against its store's limit while the cache lives, when the store's
/// limit counts them (StoreLimit::blocks_and_own_rows); otherwise empty. It holds the store, so
/// it may outlive the cache's other references to it.
class OwnRowsCharge {
 public:
  OwnRowsCharge() = default;
  /// `from`: a reservation of the store to draw the charge on (a pool load reserves its
  /// sequences' own rows with their blocks), so it cannot be refused for the limit; it throws
  /// capacity_exceeded only when the reservation holds too few blocks.
  OwnRowsCharge(std::shared_ptr<BlockStore> store, std::size_t own_bytes, const std::string& what,
                BlockReservation* from = nullptr) {
    if (store == nullptr || store->limit() != StoreLimit::blocks_and_own_rows) return;
    const std::size_t blocks = store->blocks_holding(own_bytes);
    if (from == nullptr)
      store->charge(blocks, what);
    else if (!from->charge(*store, blocks))
      throw Error(ErrorCode::capacity_exceeded, what + " take " + std::to_string(blocks) +
                                                    " blocks, more than were reserved for them (" +
                                                    std::to_string(from->blocks()) + ")");
    store_ = std::move(store);
    blocks_ = blocks;
  }
  OwnRowsCharge(OwnRowsCharge&& other) noexcept
      : store_(std::move(other.store_)), blocks_(std::exchange(other.blocks_, 0)) {}
  OwnRowsCharge& operator=(OwnRowsCharge other) noexcept {
    std::swap(store_, other.store_);
    std::swap(blocks_, other.blocks_);
    return *this;
  }
  ~OwnRowsCharge() {
    if (store_ != nullptr) store_->refund(blocks_);
  }
  std::size_t blocks() const noexcept { return blocks_; }

 private:
  std::shared_ptr<BlockStore> store_;
  std::size_t blocks_ = 0;
};

}  // namespace kvq::inline v0
