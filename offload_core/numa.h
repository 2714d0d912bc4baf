// NUMA placement of pinned host memory: which node a GPU's slabs should live on, and
// helpers that put host pages there.
//
// Contract
// - Choosing is pure: ChooseNumaNode reads only files under the sysfs root it is given, so
//   tests can hand it a fake tree. It never fails: every problem (a missing or malformed
//   file, a node reported as -1) yields "no placement" and a reason saying why.
// - Placing is best effort: a refused mbind / set_mempolicy (no permission, a node that is
//   not online, a kernel without NUMA) is not an error. The memory is then placed by the
//   kernel's default policy and the outcome's reason says what failed. Only failing to get
//   memory at all is an error.
// - MPOL_PREFERRED is used throughout: pages go to the chosen node while it has free
//   memory and spill to other nodes after that, instead of failing the allocation.
#ifndef CKPT_OFFLOAD_OFFLOAD_CORE_NUMA_H_
#define CKPT_OFFLOAD_OFFLOAD_CORE_NUMA_H_

#include <cstddef>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace ckpt_offload {
namespace numa {

inline constexpr absl::string_view kDefaultSysfsRoot = "/sys";

// Where host memory for one GPU should go.
struct NumaChoice {
  std::optional<int> node;  // set: place on this node; unset: leave placement to the kernel
  std::string reason;       // one line for logs, e.g. "node 1 (GPU 0000:3b:00.0; 2 nodes online)"
};

// Parses a sysfs node list such as "0", "0-1" or "0-3,8,10-11" (a trailing newline is
// fine) into ascending node ids. InvalidArgument on anything else, empty lists included.
absl::StatusOr<std::vector<int>> ParseNodeList(absl::string_view text);

// Parses a PCI device's numa_node file: an integer >= -1 ("-1": no node known).
absl::StatusOr<int> ParseNumaNodeFile(absl::string_view text);

// The sysfs directory name of a PCI bus id as CUDA or NVML print it: lowercase, the domain
// cut to 4 hex digits when it has leading zeros ("00000000:3B:00.0" -> "0000:3b:00.0").
// InvalidArgument when `bus_id` is not of the form domain:bus:device.function.
absl::StatusOr<std::string> NormalizePciBusId(absl::string_view bus_id);

// The node for host memory serving the GPU at `pci_bus_id`: its numa_node when the machine
// has more than one online node, otherwise none. Reads
// `sysfs_root`/devices/system/node/online and `sysfs_root`/bus/pci/devices/<id>/numa_node.
NumaChoice ChooseNumaNode(absl::string_view pci_bus_id,
                          absl::string_view sysfs_root = kDefaultSysfsRoot);

// What happened when memory was placed.
struct Placement {
  bool placed = false;  // the policy for `node` was applied
  std::string reason;   // empty when placed; else why the memory is unplaced
};

// An anonymous private read-write mapping of `bytes` rounded up to the page size, every page
// resident on return. With `node` set, the range is mbind()-ed to it (MPOL_PREFERRED)
// before any page is touched, so the pages are allocated there. `placement` (optional)
// receives the outcome. A mapping of 2 MiB or more starts on a 2 MiB boundary and is
// advised for transparent huge pages; large ones are faulted in by several threads. A
// forked child does not inherit the mapping (MADV_DONTFORK).
// ResourceExhausted when the mapping fails or asks for more than AvailableHostBytes()
// (nothing stays mapped then). Release with UnmapHostMemory(ptr, bytes), same `bytes`.
absl::StatusOr<void*> MapHostMemory(size_t bytes, std::optional<int> node,
                                    Placement* placement = nullptr);
void UnmapHostMemory(void* ptr, size_t bytes);

// Host memory this process can still fault in: `proc_root`/meminfo's MemAvailable, lowered
// to the headroom of this process's cgroup v2 group and each of its ancestors under
// `cgroup_root` (from `proc_root`/self/cgroup's "0::" line): memory.max minus
// memory.current, plus the group's reclaimable page cache (memory.stat's file - shmem).
// Groups without a limit, or unreadable, lower nothing. NotFound when meminfo is
// unreadable or has no MemAvailable line.
absl::StatusOr<size_t> AvailableHostBytes(absl::string_view proc_root = "/proc",
                                          absl::string_view cgroup_root = "/sys/fs/cgroup");

// Sets the calling thread's memory policy to MPOL_PREFERRED `node` for the scope's
// lifetime and restores the previous policy (mode, flags and nodes) at its end. Memory the
// thread faults in meanwhile (cudaHostAlloc's, say) is allocated on `node` where possible.
// With `node` unset it does nothing. placement() tells whether the policy was applied.
class ScopedPreferredNode {
 public:
  explicit ScopedPreferredNode(std::optional<int> node);
  ~ScopedPreferredNode();
  ScopedPreferredNode(const ScopedPreferredNode&) = delete;
  ScopedPreferredNode& operator=(const ScopedPreferredNode&) = delete;

  const Placement& placement() const { return placement_; }

 private:
  static constexpr size_t kMaskWords = 16;  // 1024 nodes, the kernel's largest MAX_NUMNODES
  Placement placement_;
  bool restore_ = false;
  int saved_mode_ = 0;
  unsigned long saved_mask_[kMaskWords] = {};
};

// The node holding the (resident) page at `address`, from get_mempolicy; for tests and
// diagnostics.
absl::StatusOr<int> NodeOfAddress(const void* address);

}  // namespace numa
}  // namespace ckpt_offload

#endif  // CKPT_OFFLOAD_OFFLOAD_CORE_NUMA_H_
