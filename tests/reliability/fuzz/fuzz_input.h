// Reads a fuzz input as a stream of small integers; past its end every read is 0, so any
// byte string decodes to some valid program.
#ifndef CKPT_OFFLOAD_TESTS_RELIABILITY_FUZZ_FUZZ_INPUT_H_
#define CKPT_OFFLOAD_TESTS_RELIABILITY_FUZZ_FUZZ_INPUT_H_

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>

namespace ckpt_offload::fuzz {

class Input {
 public:
  Input(const uint8_t* data, size_t size) : data_(data), size_(size) {}

  bool empty() const { return pos_ >= size_; }

  uint8_t U8() { return pos_ < size_ ? data_[pos_++] : 0; }
  uint16_t U16() { return static_cast<uint16_t>(U8() | (U8() << 8)); }
  uint32_t U32() { return static_cast<uint32_t>(U16()) | (static_cast<uint32_t>(U16()) << 16); }
  uint64_t U64() { return static_cast<uint64_t>(U32()) | (static_cast<uint64_t>(U32()) << 32); }
  // A value in [0, n) (n > 0).
  uint32_t Below(uint32_t n) { return n <= 256 ? U8() % n : U32() % n; }
  bool Bool() { return U8() & 1; }

 private:
  const uint8_t* data_;
  size_t size_;
  size_t pos_ = 0;
};

// A failed invariant: print it and abort, which libFuzzer (and the replay test) report.
#define FUZZ_CHECK(cond, ...)                                                            \
  do {                                                                                   \
    if (!(cond)) {                                                                       \
      std::fprintf(stderr, "%s:%d: FUZZ_CHECK(%s) failed: ", __FILE__, __LINE__, #cond); \
      std::fprintf(stderr, __VA_ARGS__);                                                 \
      std::fprintf(stderr, "\n");                                                        \
      std::abort();                                                                      \
    }                                                                                    \
  } while (0)

}  // namespace ckpt_offload::fuzz

#endif  // CKPT_OFFLOAD_TESTS_RELIABILITY_FUZZ_FUZZ_INPUT_H_
