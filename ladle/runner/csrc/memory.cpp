// Where the weights and the KV cache live: regions backed by 2 MiB pages (runner/cpu_kernels.py:
// tensors_to_huge_pages). A decode step streams every weight once; from torch's 4 KiB pages the
// bf16 one-row linear read 10-25% slower than from 2 MiB ones on a Zen 4 (same bytes, same loops;
// a TLB entry then covers 512 times the bytes). Attention reads each sequence's cached blocks
// from anywhere in the cache, a TLB miss per 4 KiB block on small pages.
// Storages are moved in place (StorageImpl::set_data_ptr_noswap), so every tensor and view that
// shares one keeps its object, shape and offset and sees the new memory.
#include <sys/mman.h>
#include <unistd.h>
#if defined(__GLIBC__)
#include <malloc.h>
#endif

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <unordered_set>

#include "kernels.h"

namespace {

constexpr size_t kHugePage = size_t(2) << 20;
constexpr size_t kAlign = 64;  // each storage's start: a cache line, as torch's allocator gives

// The mapping, unmapped when the last storage placed in it is freed.
struct Region {
  void* base = nullptr;
  size_t len = 0;
  ~Region() {
    if (base != nullptr) munmap(base, len);
  }
};

struct Placed {  // one storage's DataPtr context: keeps the region alive
  std::shared_ptr<Region> region;
};

void release_placed(void* ctx) { delete static_cast<Placed*>(ctx); }

size_t round_up(size_t n, size_t to) { return (n + to - 1) / to * to; }

}  // namespace

int64_t to_huge_pages(const std::vector<at::Tensor>& tensors, bool zero) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  std::vector<c10::StorageImpl*> storages;
  std::unordered_set<c10::StorageImpl*> seen;
  size_t total = 0;
  for (const auto& t : tensors) {
    if (!t.defined() || !t.device().is_cpu() || !t.has_storage()) continue;
    c10::StorageImpl* s = t.storage().unsafeGetStorageImpl();
    if (s->nbytes() == 0 || s->data() == nullptr || !seen.insert(s).second) continue;
    storages.push_back(s);
    total += round_up(s->nbytes(), kAlign);
  }
  if (storages.empty()) return 0;
  // A mapping aligned to 2 MiB: map one huge page more, then cut the ends off.
  const size_t len = round_up(total, kHugePage);
  void* raw = mmap(nullptr, len + kHugePage, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (raw == MAP_FAILED) return 0;  // no room for the mapping: the weights stay where they are
  char* base = reinterpret_cast<char*>(round_up(reinterpret_cast<uintptr_t>(raw), kHugePage));
  const size_t head = base - static_cast<char*>(raw);
  if (head) munmap(raw, head);
  if (kHugePage - head) munmap(base + len, kHugePage - head);
  auto region = std::make_shared<Region>();
  region->base = base;
  region->len = len;
  // Before the first touch: the page faults below then take 2 MiB pages where the kernel has
  // them (transparent_hugepage "madvise" or "always"), 4 KiB pages otherwise.
  madvise(base, len, MADV_HUGEPAGE);
  size_t offset = 0;
  for (c10::StorageImpl* s : storages) {
    char* dst = base + offset;
    if (zero) std::memset(dst, 0, s->nbytes());  // touched now: the memory is had at start
    else std::memcpy(dst, s->data(), s->nbytes());
    // The old DataPtr is freed here, so the copy holds at most one storage twice at a time.
    s->set_data_ptr_noswap(
        at::DataPtr(dst, new Placed{region}, &release_placed, at::Device(at::kCPU)));
    offset += round_up(s->nbytes(), kAlign);
  }
#if defined(__GLIBC__)
  malloc_trim(0);  // the old storages' heap pages back to the system now, not at the next trim
#endif
  return static_cast<int64_t>(total);
#else
  (void)tensors, (void)zero;
  return 0;
#endif
}

// dst[rows[i]] = src[i] for each of src's D rows (dst (N, ...), src (D, ...), one dtype, both
// contiguous): each row one memcpy, rows split over the threads. A hybrid model's commit writes
// each sequence's new recurrent state (1 MiB a layer at Qwen3.5's shapes) into its slot this
// way; torch's indexed assignment copied it element by element through its index kernel at a
// third of memcpy's speed (44 against 15 us a MiB, warm).
void copy_rows(at::Tensor dst, at::Tensor rows, at::Tensor src) {
  TORCH_CHECK(dst.dim() >= 1 && src.dim() == dst.dim() && src.size(0) == rows.numel() &&
                  dst.is_contiguous() && src.is_contiguous() &&
                  dst.scalar_type() == src.scalar_type() && rows.scalar_type() == at::kLong,
              "copy_rows: dst (N, ...) and src (D, ...) contiguous of one dtype, rows (D,) int64");
  for (int64_t d = 1; d < dst.dim(); ++d)
    TORCH_CHECK(dst.size(d) == src.size(d), "copy_rows: dst and src rows of one shape");
  auto r = rows.contiguous();
  const int64_t* row = r.data_ptr<int64_t>();
  const int64_t D = rows.numel(), N = dst.size(0);
  for (int64_t i = 0; i < D; ++i)
    TORCH_CHECK(row[i] >= 0 && row[i] < N, "copy_rows: row ", row[i], " out of 0..", N - 1);
  const size_t bytes = size_t(src.numel() / std::max<int64_t>(D, 1)) * src.element_size();
  auto* out = static_cast<char*>(dst.data_ptr());
  const auto* in = static_cast<const char*>(src.data_ptr());
  // pieces of at most 256 KiB, so one row's copy spreads over the threads too
  const size_t piece = std::min<size_t>(bytes, 256 << 10);
  const int64_t per_row = bytes == 0 ? 0 : int64_t((bytes + piece - 1) / piece);
  at::parallel_for(0, D * per_row, 1, [&](int64_t b, int64_t e) {
    for (int64_t p = b; p < e; ++p) {
      const int64_t i = p / per_row;
      const size_t off = size_t(p % per_row) * piece, n = std::min(piece, bytes - off);
      std::memcpy(out + size_t(row[i]) * bytes + off, in + size_t(i) * bytes + off, n);
    }
  });
}
