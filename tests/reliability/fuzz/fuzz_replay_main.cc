// Runs a libFuzzer target without libFuzzer: every file named on the command line (the seed
// corpus, or crash reproducers), then a fixed number of deterministic pseudo-random inputs.
// The target aborts on a broken invariant, so the test fails with its message.
//
//   arena_fuzz_replay_test corpus/arena_fuzz/*      # what Bazel runs
//   FUZZ_REPLAY_RANDOM=100000 arena_fuzz_replay_test crash-1234
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iterator>
#include <random>
#include <string>
#include <vector>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size);

int main(int argc, char** argv) {
  int files = 0;
  for (int i = 1; i < argc; ++i) {
    std::ifstream in(argv[i], std::ios::binary);
    if (!in) {
      std::fprintf(stderr, "cannot read %s\n", argv[i]);
      return 2;
    }
    std::vector<uint8_t> bytes((std::istreambuf_iterator<char>(in)),
                               std::istreambuf_iterator<char>());
    LLVMFuzzerTestOneInput(bytes.data(), bytes.size());
    ++files;
  }
  const char* env = std::getenv("FUZZ_REPLAY_RANDOM");
  const int random_inputs = env != nullptr ? std::atoi(env) : 2000;
  std::mt19937_64 rng(20261202);
  for (int i = 0; i < random_inputs; ++i) {
    std::vector<uint8_t> bytes(rng() % 512);
    for (uint8_t& b : bytes) b = static_cast<uint8_t>(rng());
    LLVMFuzzerTestOneInput(bytes.data(), bytes.size());
  }
  std::printf("replayed %d corpus files and %d random inputs\n", files, random_inputs);
  return files > 0 ? 0 : 3;  // a missing corpus must not pass silently
}
