// NUMA placement of pinned host memory; see numa.h for the contract.
//
// Design note
// - The node comes from sysfs, not from libnuma's topology calls or NVML: sysfs is where
//   both of those read it, it needs no GPU library, and a test can point the reader at a
//   fake tree. A single online node means there is nothing to choose; a GPU whose
//   numa_node is -1 (common in VMs and on single-socket boards) has no preference.
// - Slabs for cudaHostRegister are mapped without MAP_POPULATE: populating first would
//   place every page by the default policy before mbind could say where they belong. The
//   pages are faulted in after mbind, by writes.
// - Mapping speed is what a step that grows the pool waits for. Measured on H200 hosts
//   (benchmarks/pin_bench.py): cudaHostAlloc takes 0.3-0.7 s per GiB, and so does a
//   MADV_POPULATE_WRITE of 4 KiB pages, from one thread or eight (it does not scale).
//   Writes from eight threads do scale, and with transparent huge pages (MADV_HUGEPAGE on
//   a 2 MiB-aligned range) one fault zeroes 2 MiB: 0.06-0.07 s per GiB, registering
//   included. So the range is aligned, advised, and written by up to kMaxFaultThreads
//   threads, a share each. Huge pages are a hint: where the kernel gives none (THP off,
//   no contiguous memory) the same writes fault 4 KiB pages (0.13-0.2 s per GiB).
// - A write fault that finds no memory wakes the OOM killer rather than failing, so the
//   mapping is refused up front when it exceeds what is available: MemAvailable, lowered
//   by the headroom of the process's cgroup v2 group and its ancestors (containers),
//   where page cache other than shmem counts as free, as it does in MemAvailable.
// - MPOL_PREFERRED rather than MPOL_BIND: a full node spills to its neighbours instead of
//   failing the allocation (or waking the OOM killer), so placement never costs memory
//   the pool could otherwise have had.
// - No libnuma: mbind, set_mempolicy and get_mempolicy are system calls, and libnuma's
//   functions of those names only forward to them. Calling them directly (with the
//   kernel's <linux/mempolicy.h>, which every libc development install has) leaves
//   nothing for the build to find and nothing to be missing at run time, so placement is
//   always compiled in; on a kernel without NUMA the calls fail and the reason says so.
#include "offload_core/numa.h"

#include <fcntl.h>
#include <linux/mempolicy.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstdint>
#include <cstring>
#include <string>
#include <system_error>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"

namespace ckpt_offload {
namespace numa {
namespace {

constexpr size_t kBitsPerWord = sizeof(unsigned long) * CHAR_BIT;
constexpr int kMaxNode = 1023;  // the kernel's largest MAX_NUMNODES is 1024
constexpr size_t kMaxSysfsFileBytes = 4096;

std::string ErrnoText(int err) { return std::strerror(err); }

// The memory-policy system calls (see the design note): 0 on success, else -1 and errno.
int Mbind(void* start, size_t len, int mode, const unsigned long* nodemask, unsigned long maxnode,
          unsigned flags) {
  return static_cast<int>(syscall(SYS_mbind, start, len, mode, nodemask, maxnode, flags));
}

int SetMempolicy(int mode, const unsigned long* nodemask, unsigned long maxnode) {
  return static_cast<int>(syscall(SYS_set_mempolicy, mode, nodemask, maxnode));
}

int GetMempolicy(int* mode, unsigned long* nodemask, unsigned long maxnode, void* address,
                 unsigned long flags) {
  return static_cast<int>(syscall(SYS_get_mempolicy, mode, nodemask, maxnode, address, flags));
}

// The whole (small) file at `path`. Uses read(2) so a directory or an unreadable file is an
// error with the system's text rather than an empty string.
absl::StatusOr<std::string> ReadSmallFile(const std::string& path) {
  const int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    const int err = errno;
    return absl::NotFoundError(absl::StrCat("cannot open ", path, ": ", ErrnoText(err)));
  }
  std::string text;
  char buffer[512];
  while (text.size() < kMaxSysfsFileBytes) {
    const ssize_t n = read(fd, buffer, sizeof(buffer));
    if (n == 0) break;
    if (n < 0) {
      const int err = errno;
      if (err == EINTR) continue;
      close(fd);
      return absl::UnavailableError(absl::StrCat("cannot read ", path, ": ", ErrnoText(err)));
    }
    text.append(buffer, static_cast<size_t>(n));
  }
  close(fd);
  return text;
}

bool ParseNodeId(absl::string_view text, int* node) {
  if (text.empty() || !absl::ascii_isdigit(static_cast<unsigned char>(text[0]))) return false;
  return absl::SimpleAtoi(text, node) && *node >= 0 && *node <= kMaxNode;
}

bool IsHex(absl::string_view text) {
  return !text.empty() && std::all_of(text.begin(), text.end(), [](char c) {
    return absl::ascii_isxdigit(static_cast<unsigned char>(c));
  });
}

// A node mask with only `node` set, sized in whole words, and the `maxnode` argument the
// mempolicy system calls expect for it (the kernel reads maxnode - 1 bits).
std::vector<unsigned long> MaskOf(int node, unsigned long* maxnode) {
  std::vector<unsigned long> mask(static_cast<size_t>(node) / kBitsPerWord + 1, 0);
  mask[static_cast<size_t>(node) / kBitsPerWord] = 1UL
                                                   << (static_cast<size_t>(node) % kBitsPerWord);
  *maxnode = mask.size() * kBitsPerWord + 1;
  return mask;
}

size_t PageSize() {
  const long page = sysconf(_SC_PAGESIZE);
  return page > 0 ? static_cast<size_t>(page) : 4096;
}

size_t RoundUpToPage(size_t bytes) {
  const size_t page = PageSize();
  return (bytes + page - 1) / page * page;
}

constexpr size_t kHugePageBytes = size_t{2} << 20;
// Fault-in threads: at most this many, and each gets at least kMinBytesPerFaultThread.
constexpr unsigned kMaxFaultThreads = 8;
constexpr size_t kMinBytesPerFaultThread = size_t{64} << 20;

// Writes one byte per page of [ptr, ptr + bytes), which faults each page in under the
// range's policy.
void TouchPages(char* ptr, size_t bytes) {
  volatile char* bytes_ptr = ptr;
  const size_t page = PageSize();
  for (size_t offset = 0; offset < bytes; offset += page) bytes_ptr[offset] = 0;
}

// TouchPages over [ptr, ptr + bytes), split over threads (see the design note). A thread
// that cannot be started leaves its share and the rest to the calling thread.
void FaultIn(char* ptr, size_t bytes) {
  const size_t hardware = std::max(1u, std::thread::hardware_concurrency());
  const size_t threads = std::clamp<size_t>(bytes / kMinBytesPerFaultThread, 1,
                                            std::min<size_t>(kMaxFaultThreads, hardware));
  // Shares are whole huge pages, so no two threads fault the same one.
  const size_t share = (bytes / threads + kHugePageBytes - 1) / kHugePageBytes * kHugePageBytes;
  std::vector<std::thread> workers;
  size_t inline_from = bytes;
  for (size_t start = share; start < bytes; start += share) {
    try {
      workers.emplace_back(TouchPages, ptr + start, std::min(share, bytes - start));
    } catch (const std::system_error&) {
      inline_from = start;
      break;
    }
  }
  TouchPages(ptr, std::min(share, bytes));
  if (inline_from < bytes) TouchPages(ptr + inline_from, bytes - inline_from);
  for (std::thread& worker : workers) worker.join();
}

// The value in bytes of the `key` line of /proc/meminfo ("MemAvailable:   123456 kB") or
// of a cgroup's memory.stat ("file 123456"); a longer key that starts with `key` is another.
std::optional<size_t> KeyedBytes(absl::string_view text, absl::string_view key) {
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    if (!absl::ConsumePrefix(&line, key)) continue;
    if (!absl::ConsumePrefix(&line, ":") && !absl::ConsumePrefix(&line, " ")) continue;
    line = absl::StripAsciiWhitespace(line);
    const bool kib = absl::ConsumeSuffix(&line, "kB");
    size_t value = 0;
    if (!absl::SimpleAtoi(absl::StripAsciiWhitespace(line), &value)) return std::nullopt;
    return kib ? value * 1024 : value;
  }
  return std::nullopt;
}

// A cgroup v2 file holding one number, or "max" (nullopt: no limit, or unreadable).
std::optional<size_t> CgroupNumber(const std::string& path) {
  absl::StatusOr<std::string> text = ReadSmallFile(path);
  size_t value = 0;
  if (!text.ok() || !absl::SimpleAtoi(absl::StripAsciiWhitespace(*text), &value)) {
    return std::nullopt;
  }
  return value;
}

// mmap of `mapped` bytes whose start is 2 MiB-aligned when `mapped` is at least that, so
// the kernel can back it with huge pages: maps one huge page more and unmaps the slack.
void* MapAligned(size_t mapped) {
  if (mapped < kHugePageBytes) {
    return mmap(nullptr, mapped, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  }
  const size_t padded = mapped + kHugePageBytes;
  void* raw = mmap(nullptr, padded, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (raw == MAP_FAILED) return raw;
  const uintptr_t start = reinterpret_cast<uintptr_t>(raw);
  const uintptr_t aligned = (start + kHugePageBytes - 1) / kHugePageBytes * kHugePageBytes;
  if (aligned > start) munmap(raw, aligned - start);
  const uintptr_t end = start + padded;
  if (end > aligned + mapped) {
    munmap(reinterpret_cast<void*>(aligned + mapped), end - aligned - mapped);
  }
  return reinterpret_cast<void*>(aligned);
}

}  // namespace

absl::StatusOr<std::vector<int>> ParseNodeList(absl::string_view text) {
  const absl::string_view list = absl::StripAsciiWhitespace(text);
  if (list.empty()) return absl::InvalidArgumentError("empty node list");
  std::vector<int> nodes;
  for (absl::string_view item : absl::StrSplit(list, ',')) {
    const std::pair<absl::string_view, absl::string_view> range =
        absl::StrSplit(item, absl::MaxSplits('-', 1));
    const bool is_range = absl::StrContains(item, '-');
    int first = 0;
    bool ok = ParseNodeId(range.first, &first);
    int last = first;
    if (ok && is_range) ok = ParseNodeId(range.second, &last) && first <= last;
    if (!ok) {
      return absl::InvalidArgumentError(
          absl::StrCat("malformed node list '", list, "' (at '", item, "')"));
    }
    for (int node = first; node <= last; ++node) nodes.push_back(node);
  }
  std::sort(nodes.begin(), nodes.end());
  nodes.erase(std::unique(nodes.begin(), nodes.end()), nodes.end());
  return nodes;
}

absl::StatusOr<int> ParseNumaNodeFile(absl::string_view text) {
  const absl::string_view value = absl::StripAsciiWhitespace(text);
  int node = 0;
  if (value == "-1") return -1;
  if (!ParseNodeId(value, &node)) {
    return absl::InvalidArgumentError(absl::StrCat("malformed numa_node '", value, "'"));
  }
  return node;
}

absl::StatusOr<std::string> NormalizePciBusId(absl::string_view bus_id) {
  const std::string id = absl::AsciiStrToLower(absl::StripAsciiWhitespace(bus_id));
  const std::vector<absl::string_view> parts = absl::StrSplit(id, ':');
  const std::pair<absl::string_view, absl::string_view> slot =
      parts.size() == 3 ? absl::StrSplit(parts[2], absl::MaxSplits('.', 1))
                        : std::pair<absl::string_view, absl::string_view>();
  if (parts.size() != 3 || !IsHex(parts[0]) || !IsHex(parts[1]) || !IsHex(slot.first) ||
      !IsHex(slot.second) || parts[2].find('.') == absl::string_view::npos) {
    return absl::InvalidArgumentError(
        absl::StrCat("malformed PCI bus id '", bus_id, "' (want domain:bus:device.function)"));
  }
  absl::string_view domain = parts[0];
  while (domain.size() > 4 && domain[0] == '0') domain.remove_prefix(1);
  return absl::StrCat(domain, ":", parts[1], ":", parts[2]);
}

NumaChoice ChooseNumaNode(absl::string_view pci_bus_id, absl::string_view sysfs_root) {
  auto none = [](std::string why) {
    return NumaChoice{std::nullopt, absl::StrCat("no NUMA placement: ", why)};
  };
  const std::string online_path = absl::StrCat(sysfs_root, "/devices/system/node/online");
  absl::StatusOr<std::string> online_text = ReadSmallFile(online_path);
  if (!online_text.ok()) return none(std::string(online_text.status().message()));
  absl::StatusOr<std::vector<int>> online = ParseNodeList(*online_text);
  if (!online.ok()) return none(absl::StrCat(online_path, ": ", online.status().message()));
  const std::string online_list = absl::StrJoin(*online, ",");
  if (online->size() == 1) {
    return none(absl::StrCat("single NUMA node (node ", online_list, ")"));
  }

  absl::StatusOr<std::string> id = NormalizePciBusId(pci_bus_id);
  if (!id.ok()) return none(std::string(id.status().message()));
  const std::string node_path = absl::StrCat(sysfs_root, "/bus/pci/devices/", *id, "/numa_node");
  absl::StatusOr<std::string> node_text = ReadSmallFile(node_path);
  if (!node_text.ok()) return none(std::string(node_text.status().message()));
  absl::StatusOr<int> node = ParseNumaNodeFile(*node_text);
  if (!node.ok()) return none(absl::StrCat(node_path, ": ", node.status().message()));
  if (*node < 0) {
    return none(absl::StrCat("the system reports no NUMA node for GPU ", *id, " (numa_node -1)"));
  }
  if (!std::binary_search(online->begin(), online->end(), *node)) {
    return none(absl::StrCat("GPU ", *id, " is on node ", *node, ", which is not online (nodes ",
                             online_list, ")"));
  }
  return NumaChoice{
      *node, absl::StrCat("node ", *node, " (GPU ", *id, "; nodes ", online_list, " online)")};
}

absl::StatusOr<void*> MapHostMemory(size_t bytes, std::optional<int> node, Placement* placement) {
  Placement outcome;
  const size_t mapped = RoundUpToPage(bytes == 0 ? 1 : bytes);
  // Faulting in what is not there would wake the OOM killer instead of failing this call.
  if (absl::StatusOr<size_t> available = AvailableHostBytes();
      available.ok() && mapped > *available) {
    return absl::ResourceExhaustedError(
        absl::StrCat("host memory: ", mapped, " bytes asked, ", *available,
                     " available (MemAvailable, and this process's cgroup headroom)"));
  }
  void* ptr = MapAligned(mapped);
  if (ptr == MAP_FAILED) {
    const int err = errno;
    return absl::ResourceExhaustedError(
        absl::StrCat("mmap(", mapped, " bytes) failed: ", ErrnoText(err)));
  }
  if (!node.has_value()) {
    outcome.reason = "no node requested";
  } else if (*node < 0 || *node > kMaxNode) {
    outcome.reason = absl::StrCat("node ", *node, " is out of range");
  } else {
    unsigned long maxnode = 0;
    const std::vector<unsigned long> mask = MaskOf(*node, &maxnode);
    if (Mbind(ptr, mapped, MPOL_PREFERRED, mask.data(), maxnode, 0) == 0) {
      outcome.placed = true;
    } else {
      const int err = errno;
      outcome.reason =
          absl::StrCat("mbind(MPOL_PREFERRED, node ", *node, ") failed: ", ErrnoText(err));
    }
  }
  // A hint (EINVAL without THP support): the faults below fall back to 4 KiB pages.
  (void)madvise(ptr, mapped, MADV_HUGEPAGE);
  // Not inherited by a fork (DataLoader workers): a forked child would otherwise get a
  // copy of every pinned page at fork time (the kernel copies pages pinned for DMA
  // eagerly), the whole pool per worker.
  if (madvise(ptr, mapped, MADV_DONTFORK) != 0) {
    const int err = errno;
    munmap(ptr, mapped);
    return absl::InternalError(
        absl::StrCat("madvise(MADV_DONTFORK, ", mapped, " bytes) failed: ", ErrnoText(err)));
  }
  FaultIn(static_cast<char*>(ptr), mapped);
  if (placement != nullptr) *placement = std::move(outcome);
  return ptr;
}

absl::StatusOr<size_t> AvailableHostBytes(absl::string_view proc_root,
                                          absl::string_view cgroup_root) {
  const std::string meminfo_path = absl::StrCat(proc_root, "/meminfo");
  absl::StatusOr<std::string> meminfo = ReadSmallFile(meminfo_path);
  if (!meminfo.ok()) return meminfo.status();
  std::optional<size_t> available = KeyedBytes(*meminfo, "MemAvailable");
  if (!available.has_value()) {
    return absl::NotFoundError(absl::StrCat("no MemAvailable line in ", meminfo_path));
  }
  // cgroup v2: the line "0::/path" names this process's group; it and every ancestor may
  // set memory.max.
  absl::StatusOr<std::string> membership = ReadSmallFile(absl::StrCat(proc_root, "/self/cgroup"));
  if (!membership.ok()) return *available;
  for (absl::string_view line : absl::StrSplit(*membership, '\n')) {
    if (!absl::ConsumePrefix(&line, "0::")) continue;
    std::string group(absl::StripAsciiWhitespace(line));
    while (true) {
      const std::string dir = absl::StrCat(cgroup_root, group);
      const std::optional<size_t> limit = CgroupNumber(dir + "/memory.max");
      std::optional<size_t> used = CgroupNumber(dir + "/memory.current");
      if (limit.has_value() && used.has_value()) {
        // Page cache counts as used but is reclaimed under the limit (shmem is not).
        absl::StatusOr<std::string> stat = ReadSmallFile(dir + "/memory.stat");
        if (stat.ok()) {
          const size_t file = KeyedBytes(*stat, "file").value_or(0);
          const size_t shmem = KeyedBytes(*stat, "shmem").value_or(0);
          const size_t reclaimable = file > shmem ? file - shmem : 0;
          *used -= std::min(*used, reclaimable);
        }
        *available = std::min(*available, *limit > *used ? *limit - *used : 0);
      }
      if (group.empty() || group == "/") break;
      const size_t slash = group.find_last_of('/');
      group = slash == 0 || slash == std::string::npos ? "/" : group.substr(0, slash);
    }
  }
  return *available;
}

void UnmapHostMemory(void* ptr, size_t bytes) {
  if (ptr == nullptr) return;
  munmap(ptr, RoundUpToPage(bytes == 0 ? 1 : bytes));
}

ScopedPreferredNode::ScopedPreferredNode(std::optional<int> node) {
  if (!node.has_value()) {
    placement_.reason = "no node requested";
    return;
  }
  if (*node < 0 || *node > kMaxNode) {
    placement_.reason = absl::StrCat("node ", *node, " is out of range");
    return;
  }
  // Saved first: a policy that cannot be restored is not changed.
  if (GetMempolicy(&saved_mode_, saved_mask_, kMaskWords * kBitsPerWord + 1, nullptr, 0) != 0) {
    const int err = errno;
    placement_.reason = absl::StrCat("get_mempolicy failed: ", ErrnoText(err));
    return;
  }
  unsigned long maxnode = 0;
  const std::vector<unsigned long> mask = MaskOf(*node, &maxnode);
  if (SetMempolicy(MPOL_PREFERRED, mask.data(), maxnode) != 0) {
    const int err = errno;
    placement_.reason =
        absl::StrCat("set_mempolicy(MPOL_PREFERRED, node ", *node, ") failed: ", ErrnoText(err));
    return;
  }
  placement_.placed = true;
  restore_ = true;
}

ScopedPreferredNode::~ScopedPreferredNode() {
  if (!restore_) return;
  // The saved mode carries its flags, and its mask is empty for MPOL_DEFAULT and
  // MPOL_LOCAL, as set_mempolicy wants it back.
  (void)SetMempolicy(saved_mode_, saved_mask_, kMaskWords * kBitsPerWord + 1);
}

absl::StatusOr<int> NodeOfAddress(const void* address) {
  int node = -1;
  if (GetMempolicy(&node, nullptr, 0, const_cast<void*>(address), MPOL_F_NODE | MPOL_F_ADDR) != 0) {
    const int err = errno;
    return absl::UnavailableError(
        absl::StrCat("get_mempolicy(MPOL_F_NODE | MPOL_F_ADDR) failed: ", ErrnoText(err)));
  }
  return node;
}

}  // namespace numa
}  // namespace ckpt_offload
