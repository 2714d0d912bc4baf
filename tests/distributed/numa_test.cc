// Tests for offload_core/numa.h: the node choice against fake sysfs trees, and placement of
// host pages on this machine (which places them or falls back, never fails). No CUDA.
#include "offload_core/numa.h"

#include <numaif.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <future>
#include <optional>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace ckpt_offload {
namespace numa {
namespace {

namespace fs = std::filesystem;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::StartsWith;

constexpr char kGpu[] = "0000:3b:00.0";

// A sysfs-shaped tree in a fresh temporary directory, removed at the end of the test.
class FakeSysfs {
 public:
  FakeSysfs() {
    const char* base = std::getenv("TEST_TMPDIR");
    std::string pattern = std::string(base != nullptr ? base : "/tmp") + "/fake_sysfs_XXXXXX";
    root_ = mkdtemp(pattern.data()) != nullptr ? pattern : "";
    EXPECT_FALSE(root_.empty()) << std::strerror(errno);
  }
  ~FakeSysfs() {
    std::error_code ignored;
    fs::remove_all(root_, ignored);
  }

  const std::string& root() const { return root_; }

  void Write(const std::string& relative, const std::string& text) const {
    const fs::path path = fs::path(root_) / relative;
    fs::create_directories(path.parent_path());
    std::ofstream(path) << text;
  }
  void Online(const std::string& text) const { Write("devices/system/node/online", text); }
  void GpuNode(const std::string& bus_id, const std::string& text) const {
    Write("bus/pci/devices/" + bus_id + "/numa_node", text);
  }

 private:
  std::string root_;
};

TEST(ParseNodeListTest, ParsesSingleNodesRangesAndLists) {
  EXPECT_THAT(*ParseNodeList("0\n"), ElementsAre(0));
  EXPECT_THAT(*ParseNodeList("0-1\n"), ElementsAre(0, 1));
  EXPECT_THAT(*ParseNodeList("0-3,8,10-11"), ElementsAre(0, 1, 2, 3, 8, 10, 11));
  EXPECT_THAT(*ParseNodeList("2,0-1,1"), ElementsAre(0, 1, 2));  // sorted, no duplicates
}

TEST(ParseNodeListTest, RejectsMalformedLists) {
  for (const char* text :
       {"", "\n", "zero", "1-0", "0-", "-1", "0,,1", "0-1-2", "0x1", "2000", " 0 - 1", "0;1"}) {
    absl::StatusOr<std::vector<int>> nodes = ParseNodeList(text);
    EXPECT_EQ(nodes.status().code(), absl::StatusCode::kInvalidArgument) << "'" << text << "'";
  }
}

TEST(ParseNumaNodeFileTest, ParsesNodesAndMinusOne) {
  EXPECT_EQ(*ParseNumaNodeFile("1\n"), 1);
  EXPECT_EQ(*ParseNumaNodeFile("0"), 0);
  EXPECT_EQ(*ParseNumaNodeFile("-1\n"), -1);
  for (const char* text : {"", "node1", "-2", "1.0", "+1", "99999"}) {
    EXPECT_EQ(ParseNumaNodeFile(text).status().code(), absl::StatusCode::kInvalidArgument)
        << "'" << text << "'";
  }
}

TEST(NormalizePciBusIdTest, MatchesSysfsDirectoryNames) {
  EXPECT_EQ(*NormalizePciBusId("0000:3B:00.0"), "0000:3b:00.0");
  EXPECT_EQ(*NormalizePciBusId("00000000:3B:00.0"), "0000:3b:00.0");  // NVML's 8-digit domain
  EXPECT_EQ(*NormalizePciBusId("0001:c1:00.1\n"), "0001:c1:00.1");
  EXPECT_EQ(*NormalizePciBusId("10000:01:00.0"), "10000:01:00.0");  // a VMD domain keeps 5
  for (const char* text : {"", "3b:00.0", "0000:3b:00", "0000:3g:00.0", "0000:3b:00.", "gpu0"}) {
    EXPECT_EQ(NormalizePciBusId(text).status().code(), absl::StatusCode::kInvalidArgument)
        << "'" << text << "'";
  }
}

TEST(ChooseNumaNodeTest, SingleNodeMeansNoPlacement) {
  FakeSysfs sysfs;
  sysfs.Online("0\n");
  sysfs.GpuNode(kGpu, "0\n");
  const NumaChoice choice = ChooseNumaNode(kGpu, sysfs.root());
  EXPECT_FALSE(choice.node.has_value());
  EXPECT_EQ(choice.reason, "no NUMA placement: single NUMA node (node 0)");
}

TEST(ChooseNumaNodeTest, TwoNodesPlaceOnTheGpusNode) {
  FakeSysfs sysfs;
  sysfs.Online("0-1\n");
  sysfs.GpuNode(kGpu, "1\n");
  sysfs.GpuNode("0000:86:00.0", "0\n");
  // CUDA prints the id in upper case, NVML with an 8-digit domain: both find the directory.
  for (const char* id : {"0000:3B:00.0", "00000000:3B:00.0", kGpu}) {
    const NumaChoice choice = ChooseNumaNode(id, sysfs.root());
    ASSERT_TRUE(choice.node.has_value()) << id << ": " << choice.reason;
    EXPECT_EQ(*choice.node, 1);
    EXPECT_EQ(choice.reason, "node 1 (GPU 0000:3b:00.0; nodes 0,1 online)");
  }
  EXPECT_EQ(ChooseNumaNode("0000:86:00.0", sysfs.root()).node, std::optional<int>(0));
}

TEST(ChooseNumaNodeTest, GpuWithoutNodeFallsBack) {
  FakeSysfs sysfs;
  sysfs.Online("0-1\n");
  sysfs.GpuNode(kGpu, "-1\n");
  const NumaChoice choice = ChooseNumaNode(kGpu, sysfs.root());
  EXPECT_FALSE(choice.node.has_value());
  EXPECT_THAT(choice.reason, StartsWith("no NUMA placement: "));
  EXPECT_THAT(choice.reason, HasSubstr("numa_node -1"));
}

TEST(ChooseNumaNodeTest, MissingGpuFileFallsBackNamingThePath) {
  FakeSysfs sysfs;
  sysfs.Online("0-1\n");
  const NumaChoice choice = ChooseNumaNode(kGpu, sysfs.root());
  EXPECT_FALSE(choice.node.has_value());
  EXPECT_THAT(choice.reason,
              HasSubstr("cannot open " + sysfs.root() + "/bus/pci/devices/" + kGpu + "/numa_node"));
}

TEST(ChooseNumaNodeTest, MissingOrUnreadableOnlineFileFallsBack) {
  FakeSysfs missing;
  missing.GpuNode(kGpu, "1\n");
  NumaChoice choice = ChooseNumaNode(kGpu, missing.root());
  EXPECT_FALSE(choice.node.has_value());
  EXPECT_THAT(choice.reason,
              HasSubstr("cannot open " + missing.root() + "/devices/system/node/online"));

  // A directory where the file should be: open(2) succeeds, read(2) fails (EISDIR). Tests
  // may run as root, so a mode of 000 would not make a file unreadable.
  FakeSysfs unreadable;
  unreadable.Write("devices/system/node/online/placeholder", "");
  unreadable.GpuNode(kGpu, "1\n");
  choice = ChooseNumaNode(kGpu, unreadable.root());
  EXPECT_FALSE(choice.node.has_value());
  EXPECT_THAT(choice.reason,
              HasSubstr("cannot read " + unreadable.root() + "/devices/system/node/online"));
}

TEST(ChooseNumaNodeTest, MalformedContentFallsBack) {
  struct Case {
    const char* online;
    const char* gpu_node;
    const char* bus_id;
    const char* expected;
  };
  for (const Case& c : std::vector<Case>{
           {"zero\n", "1\n", kGpu, "malformed node list 'zero'"},
           {"", "1\n", kGpu, "empty node list"},
           {"0-1\n", "node1\n", kGpu, "malformed numa_node 'node1'"},
           {"0-1\n", "", kGpu, "malformed numa_node ''"},
           {"0-1\n", "1\n", "not-a-bus-id", "malformed PCI bus id 'not-a-bus-id'"},
           {"0-1\n", "3\n", kGpu, "is on node 3, which is not online (nodes 0,1)"},
       }) {
    FakeSysfs sysfs;
    sysfs.Online(c.online);
    sysfs.GpuNode(kGpu, c.gpu_node);
    const NumaChoice choice = ChooseNumaNode(c.bus_id, sysfs.root());
    EXPECT_FALSE(choice.node.has_value()) << c.expected;
    EXPECT_THAT(choice.reason, StartsWith("no NUMA placement: "));
    EXPECT_THAT(choice.reason, HasSubstr(c.expected));
  }
}

TEST(ChooseNumaNodeTest, RealSysfsGivesAChoiceWithAReason) {
  const NumaChoice choice = ChooseNumaNode("0000:00:00.0");
  EXPECT_FALSE(choice.reason.empty());
  if (choice.node.has_value()) {
    EXPECT_GE(*choice.node, 0);
  }
}

// The nodes this machine has online (node 0 where sysfs says nothing).
std::vector<int> OnlineNodes() {
  std::ifstream file("/sys/devices/system/node/online");
  std::string text((std::istreambuf_iterator<char>(file)), std::istreambuf_iterator<char>());
  absl::StatusOr<std::vector<int>> nodes = ParseNodeList(text);
  return nodes.ok() ? *nodes : std::vector<int>{0};
}

// Checks that [ptr, ptr + bytes) reads as zeros and keeps what is written to it.
void ExpectUsable(void* ptr, size_t bytes) {
  auto* data = static_cast<unsigned char*>(ptr);
  EXPECT_EQ(data[0], 0);
  EXPECT_EQ(data[bytes - 1], 0);
  std::memset(data, 0xab, bytes);
  EXPECT_EQ(data[bytes / 2], 0xab);
}

TEST(MapHostMemoryTest, UnplacedMappingIsResidentAndUsable) {
  const size_t bytes = (size_t{4} << 20) + 100;  // not a page multiple
  Placement placement;
  absl::StatusOr<void*> ptr = MapHostMemory(bytes, std::nullopt, &placement);
  ASSERT_TRUE(ptr.ok()) << ptr.status();
  EXPECT_EQ(reinterpret_cast<uintptr_t>(*ptr) % sysconf(_SC_PAGESIZE), 0u);
  EXPECT_FALSE(placement.placed);
  EXPECT_EQ(placement.reason, "no node requested");
  // Resident on return: every page is in memory before anything touches it.
  const size_t page = sysconf(_SC_PAGESIZE);
  std::vector<unsigned char> resident((bytes + page - 1) / page);
  ASSERT_EQ(mincore(*ptr, bytes, resident.data()), 0) << std::strerror(errno);
  for (unsigned char r : resident) ASSERT_TRUE(r & 1);
  ExpectUsable(*ptr, bytes);
  UnmapHostMemory(*ptr, bytes);
}

// Virtual memory of this process in KiB (VmSize), to see that no mapping is left behind.
size_t VmSizeKib() {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line)) {
    if (line.rfind("VmSize:", 0) == 0) return std::stoul(line.substr(7));
  }
  ADD_FAILURE() << "no VmSize in /proc/self/status";
  return 0;
}

// Large mappings are populated by several threads from a 2 MiB-aligned start (so that the
// kernel may back them with huge pages); every page is still resident, and unmapping
// leaves nothing of the alignment slack behind.
TEST(MapHostMemoryTest, LargeMappingIsAlignedResidentAndLeavesNothingMapped) {
  constexpr size_t kHuge = size_t{2} << 20;
  const size_t page = sysconf(_SC_PAGESIZE);
  for (size_t bytes : {kHuge + page, (size_t{200} << 20) + 3 * page}) {
    // A first round lets the C library cache the fault threads' stacks, which would
    // otherwise show up as mapped memory in the comparison.
    for (int round = 0; round < 2; ++round) {
      const size_t vm_before = VmSizeKib();
      absl::StatusOr<void*> ptr = MapHostMemory(bytes, std::nullopt);
      ASSERT_TRUE(ptr.ok()) << ptr.status();
      EXPECT_EQ(reinterpret_cast<uintptr_t>(*ptr) % kHuge, 0u) << bytes;
      std::vector<unsigned char> resident((bytes + page - 1) / page);
      ASSERT_EQ(mincore(*ptr, bytes, resident.data()), 0) << std::strerror(errno);
      for (size_t i = 0; i < resident.size(); ++i) ASSERT_TRUE(resident[i] & 1) << "page " << i;
      ExpectUsable(*ptr, bytes);
      UnmapHostMemory(*ptr, bytes);
      if (round == 1) {
        EXPECT_EQ(VmSizeKib(), vm_before) << bytes;
      }
    }
  }
}

TEST(MapHostMemoryTest, PlacesOnEachOnlineNodeOrFallsBackWithAReason) {
  const size_t bytes = size_t{8} << 20;
  for (int node : OnlineNodes()) {
    Placement placement;
    absl::StatusOr<void*> ptr = MapHostMemory(bytes, node, &placement);
    ASSERT_TRUE(ptr.ok()) << ptr.status();
    if (placement.placed) {
      EXPECT_TRUE(placement.reason.empty());
      // MPOL_PREFERRED may spill when the node is full; 8 MiB on an idle test machine fits.
      for (size_t offset : {size_t{0}, bytes / 2, bytes - 1}) {
        absl::StatusOr<int> page_node = NodeOfAddress(static_cast<char*>(*ptr) + offset);
        ASSERT_TRUE(page_node.ok()) << page_node.status();
        EXPECT_EQ(*page_node, node) << "offset " << offset;
      }
    } else {
      // A kernel without NUMA support or a sandbox that forbids mbind: still memory.
      EXPECT_THAT(placement.reason, HasSubstr("mbind(MPOL_PREFERRED, node "));
      std::printf("node %d not placed: %s\n", node, placement.reason.c_str());
    }
    ExpectUsable(*ptr, bytes);
    UnmapHostMemory(*ptr, bytes);
  }
}

TEST(MapHostMemoryTest, RefusedPlacementFallsBackToUsableMemory) {
  const size_t bytes = size_t{1} << 20;
  Placement placement;
  absl::StatusOr<void*> ptr = MapHostMemory(bytes, 1000, &placement);  // never online
  ASSERT_TRUE(ptr.ok()) << ptr.status();
  EXPECT_FALSE(placement.placed);
  EXPECT_THAT(placement.reason, StartsWith("mbind(MPOL_PREFERRED, node 1000) failed: "));
  ExpectUsable(*ptr, bytes);
  UnmapHostMemory(*ptr, bytes);

  ptr = MapHostMemory(bytes, -3, &placement);
  ASSERT_TRUE(ptr.ok()) << ptr.status();
  EXPECT_FALSE(placement.placed);
  EXPECT_EQ(placement.reason, "node -3 is out of range");
  UnmapHostMemory(*ptr, bytes);
}

// A forked child (a DataLoader worker) does not inherit the mapping: were it inherited,
// the kernel would copy every page pinned for DMA into the child at fork time.
TEST(MapHostMemoryTest, ForkedChildDoesNotInheritTheMapping) {
  const size_t bytes = size_t{4} << 20;
  absl::StatusOr<void*> ptr = MapHostMemory(bytes, std::nullopt);
  ASSERT_TRUE(ptr.ok()) << ptr.status();
  const pid_t child = fork();
  ASSERT_GE(child, 0) << std::strerror(errno);
  if (child == 0) {
    unsigned char resident = 0;
    // mincore fails with ENOMEM on an address range that is not mapped.
    _exit(mincore(*ptr, sysconf(_SC_PAGESIZE), &resident) == -1 && errno == ENOMEM ? 0 : 1);
  }
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child) << std::strerror(errno);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0) << "the child has the mapping";
  ExpectUsable(*ptr, bytes);  // the parent still has it
  UnmapHostMemory(*ptr, bytes);
}

// A request above what the machine has is refused before anything is mapped or faulted in
// (faulting it in would wake the OOM killer instead of failing).
TEST(MapHostMemoryTest, MoreThanAvailableIsRefusedUpFront) {
  absl::StatusOr<size_t> available = AvailableHostBytes();
  ASSERT_TRUE(available.ok()) << available.status();
  for (size_t bytes : {*available + (size_t{1} << 30), size_t{1} << 62}) {
    const size_t vm_before = VmSizeKib();
    absl::StatusOr<void*> ptr = MapHostMemory(bytes, 0);
    EXPECT_EQ(ptr.status().code(), absl::StatusCode::kResourceExhausted) << bytes;
    EXPECT_THAT(std::string(ptr.status().message()), HasSubstr(" available ")) << bytes;
    EXPECT_EQ(VmSizeKib(), vm_before) << bytes;
  }
}

constexpr char kMeminfo[] =
    "MemTotal:       24000000 kB\nMemFree:         1000000 kB\n"
    "MemAvailable:   20000000 kB\nBuffers:          1000 kB\n";
constexpr size_t kMemAvailableBytes = size_t{20000000} * 1024;

TEST(AvailableHostBytesTest, MemAvailableWithoutCgroupLimits) {
  FakeSysfs proc;
  proc.Write("meminfo", kMeminfo);
  EXPECT_EQ(AvailableHostBytes(proc.root(), proc.root()).value(), kMemAvailableBytes);
  // cgroup v1 only (no "0::" line), or the root group, or groups without a limit.
  FakeSysfs cgroup;
  for (const char* membership : {"1:memory:/job\n", "0::/\n", "0::/a/b\n"}) {
    proc.Write("self/cgroup", membership);
    cgroup.Write("a/b/memory.max", "max\n");
    cgroup.Write("a/b/memory.current", "123\n");
    EXPECT_EQ(AvailableHostBytes(proc.root(), cgroup.root()).value(), kMemAvailableBytes)
        << membership;
  }
}

TEST(AvailableHostBytesTest, TheTightestGroupOnThePathLowersIt) {
  FakeSysfs proc, cgroup;
  proc.Write("meminfo", kMeminfo);
  proc.Write("self/cgroup", "0::/pod/container\n");
  cgroup.Write("pod/container/memory.max", "max\n");
  cgroup.Write("pod/container/memory.current", "1000\n");
  cgroup.Write("pod/memory.max", "8589934592\n");      // 8 GiB for the pod
  cgroup.Write("pod/memory.current", "6442450944\n");  // 6 GiB of it used
  EXPECT_EQ(AvailableHostBytes(proc.root(), cgroup.root()).value(), size_t{2} << 30);
  // Its page cache is reclaimable, shmem is not.
  // Keys that merely start like the wanted ones (file_mapped, shmem_thp) are other lines.
  cgroup.Write("pod/memory.stat",
               "anon 1000\nfile_mapped 7\nfile 1073741824\nkernel 10\nshmem_thp 9\n"
               "shmem 536870912\n");
  EXPECT_EQ(AvailableHostBytes(proc.root(), cgroup.root()).value(),
            (size_t{2} << 30) + (size_t{512} << 20));
  // A group over its limit (reclaim pending) has no headroom at all.
  cgroup.Write("pod/container/memory.max", "4096\n");
  cgroup.Write("pod/container/memory.current", "8192\n");
  EXPECT_EQ(AvailableHostBytes(proc.root(), cgroup.root()).value(), 0u);
  // The namespace root of a container ("0::/") can carry the limit itself.
  proc.Write("self/cgroup", "0::/\n");
  cgroup.Write("memory.max", "1048576\n");
  cgroup.Write("memory.current", "0\n");
  EXPECT_EQ(AvailableHostBytes(proc.root(), cgroup.root()).value(), size_t{1} << 20);
}

TEST(AvailableHostBytesTest, NoMemAvailableIsNotFound) {
  FakeSysfs proc;
  EXPECT_EQ(AvailableHostBytes(proc.root(), proc.root()).status().code(),
            absl::StatusCode::kNotFound);
  proc.Write("meminfo", "MemTotal:       24000000 kB\n");
  absl::StatusOr<size_t> available = AvailableHostBytes(proc.root(), proc.root());
  EXPECT_EQ(available.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(std::string(available.status().message()), HasSubstr("MemAvailable"));
}

// The calling thread's policy mode and the first word of its node mask.
std::pair<int, unsigned long> ThreadPolicy() {
  int mode = -1;
  unsigned long mask[16] = {};
  EXPECT_EQ(get_mempolicy(&mode, mask, 16 * 64 + 1, nullptr, 0), 0) << std::strerror(errno);
  return {mode, mask[0]};
}

TEST(ScopedPreferredNodeTest, SetsAndRestoresTheCallingThreadsPolicy) {
  const std::pair<int, unsigned long> before = ThreadPolicy();
  // A thread started before the scope: the policy is per thread, so it keeps its own.
  std::promise<void> inside_scope;
  std::future<std::pair<int, unsigned long>> other_policy =
      std::async(std::launch::async, [entered = inside_scope.get_future()]() mutable {
        entered.wait();
        return ThreadPolicy();
      });
  {
    ScopedPreferredNode preferred(0);
    inside_scope.set_value();
    EXPECT_EQ(other_policy.get(), before);
    if (!preferred.placement().placed) {
      EXPECT_THAT(preferred.placement().reason, HasSubstr("set_mempolicy"));
      EXPECT_EQ(ThreadPolicy(), before);
      GTEST_SKIP() << "this kernel refuses thread policies: " << preferred.placement().reason;
    }
    EXPECT_EQ(ThreadPolicy(), std::make_pair(int{MPOL_PREFERRED}, 1UL));
    {
      ScopedPreferredNode nested(0);
      EXPECT_TRUE(nested.placement().placed);
    }
    // The nested scope restored a policy that was not the default one.
    EXPECT_EQ(ThreadPolicy(), std::make_pair(int{MPOL_PREFERRED}, 1UL));
  }
  EXPECT_EQ(ThreadPolicy(), before);
}

TEST(ScopedPreferredNodeTest, NoNodeOrARefusedNodeLeavesThePolicyAlone) {
  const std::pair<int, unsigned long> before = ThreadPolicy();
  {
    ScopedPreferredNode none(std::nullopt);
    EXPECT_FALSE(none.placement().placed);
    EXPECT_EQ(ThreadPolicy(), before);
  }
  {
    ScopedPreferredNode refused(1000);
    EXPECT_FALSE(refused.placement().placed);
    EXPECT_THAT(refused.placement().reason,
                StartsWith("set_mempolicy(MPOL_PREFERRED, node 1000) failed: "));
    EXPECT_EQ(ThreadPolicy(), before);
  }
  EXPECT_EQ(ThreadPolicy(), before);
}

}  // namespace
}  // namespace numa
}  // namespace ckpt_offload
