// MutexLock: absl::MutexLock that ThreadSanitizer can see.
//
// The system's abseil (Debian's libabsl) is not built with TSan, so under --config=tsan an
// absl::Mutex orders nothing TSan knows of, and every access it guards reads as a race.
// In TSan builds this lock also tells TSan what a mutex means (acquire after Lock, release
// before Unlock); elsewhere it is absl::MutexLock exactly, annotations included.
#ifndef CKPT_OFFLOAD_TORCH_PLUGIN_CSRC_MUTEX_LOCK_H_
#define CKPT_OFFLOAD_TORCH_PLUGIN_CSRC_MUTEX_LOCK_H_

#include "absl/base/config.h"
#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"

#ifdef ABSL_HAVE_THREAD_SANITIZER
#include <sanitizer/tsan_interface.h>
#endif

namespace ckpt_offload::torch_plugin {

class ABSL_SCOPED_LOCKABLE MutexLock {
 public:
  explicit MutexLock(absl::Mutex* mu) ABSL_EXCLUSIVE_LOCK_FUNCTION(mu) : mu_(mu) {
    mu_->Lock();
#ifdef ABSL_HAVE_THREAD_SANITIZER
    __tsan_acquire(mu_);
#endif
  }
  ~MutexLock() ABSL_UNLOCK_FUNCTION() {
#ifdef ABSL_HAVE_THREAD_SANITIZER
    __tsan_release(mu_);
#endif
    mu_->Unlock();
  }
  MutexLock(const MutexLock&) = delete;
  MutexLock& operator=(const MutexLock&) = delete;

 private:
  absl::Mutex* const mu_;
};

}  // namespace ckpt_offload::torch_plugin

#endif  // CKPT_OFFLOAD_TORCH_PLUGIN_CSRC_MUTEX_LOCK_H_
