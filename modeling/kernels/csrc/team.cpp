// The kernels' thread team (team.h): helpers that look for the next call for a while, then sleep on a futex.
#include "team.h"

#include <ATen/Parallel.h>
#include <c10/util/ParallelGuard.h>
#include <linux/futex.h>
#include <pthread.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <exception>
#include <system_error>
#include <climits>
#include <cstdint>
#include <thread>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace specserve {
namespace {

// How long a helper looks for the next call before it sleeps: through a step (its calls come microseconds apart) and
// through the gap between two steps of a busy server (the scheduler's round trip), so that it keeps its core. A
// helper that slept there found the core taken by whatever ran meanwhile, a neighbour at nice 19 included, and a
// server beside one lost about a tenth of its speed (docs/benchmarks.md). An idle server's helpers sleep.
constexpr auto kHelperSpin = std::chrono::milliseconds(20);
// How long a caller whose work is done looks for the helpers inside the call to leave before it sleeps: a helper
// still inside after that has most likely lost its core, and a caller that sleeps lets the OS move it to this one.
constexpr auto kCallerSpin = std::chrono::microseconds(20);
// Helpers at most (a call asks for more threads than that gets this many).
constexpr int64_t kMaxHelpers = 255;
// A helper that had its core for less than this share of the time it wanted it (spinning or working, over a window
// of kWatchWindow of such time) shares the core with another process as busy as itself: it then takes a core's
// time from the caller as often as it gives the caller help, and it stands aside for a while (kFirstRest, doubled
// while that goes on, up to kLongestRest). A neighbour at a lower priority takes little of its time, and it stays.
constexpr double kMinCoreShare = 0.75;
constexpr auto kWatchWindow = std::chrono::milliseconds(50);
constexpr auto kWatchEvery = std::chrono::milliseconds(1);
constexpr auto kFirstRest = std::chrono::milliseconds(100);
constexpr auto kLongestRest = std::chrono::milliseconds(2000);

inline void relax() {
#if defined(__x86_64__)
  _mm_pause();
#else
  std::this_thread::yield();
#endif
}

// Sleeps while *word == expected (or until woken; the caller checks again).
void futex_wait(std::atomic<uint32_t>& word, uint32_t expected) {
  static_assert(sizeof(std::atomic<uint32_t>) == sizeof(uint32_t));
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(&word), FUTEX_WAIT_PRIVATE, expected, nullptr, nullptr, 0);
}

// Sleeps while *word == expected, for `limit` at most.
void futex_wait_for(std::atomic<uint32_t>& word, uint32_t expected, std::chrono::nanoseconds limit) {
  timespec timeout{static_cast<time_t>(limit.count() / 1000000000), static_cast<long>(limit.count() % 1000000000)};
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(&word), FUTEX_WAIT_PRIVATE, expected, &timeout, nullptr, 0);
}

void futex_wake_all(std::atomic<uint32_t>& word) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(&word), FUTEX_WAKE_PRIVATE, INT_MAX, nullptr, nullptr, 0);
}

// Looks at `done` until it says so or `limit` has passed; whether it said so.
template <typename Done>
bool spin_until(const Done& done, std::chrono::microseconds limit) {
  const auto start = std::chrono::steady_clock::now();
  for (uint32_t round = 1;; ++round) {
    if (done()) return true;
    relax();
    if (round % 64 == 0 && std::chrono::steady_clock::now() - start > limit) return done();
  }
}

std::chrono::nanoseconds thread_cpu_time() {
  timespec now{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &now);
  return std::chrono::seconds(now.tv_sec) + std::chrono::nanoseconds(now.tv_nsec);
}

// How much of the time a helper wanted its core it had it (kMinCoreShare says what follows from that).
class CoreWatch {
 public:
  // Counts the time from now as time this thread wants its core.
  void want() {
    if (wanting_) return;
    wanting_ = true;
    since_ = std::chrono::steady_clock::now();
    cpu_since_ = thread_cpu_time();
  }

  // Stops counting (the thread sleeps).
  void rest() {
    if (!wanting_) return;
    wanting_ = false;
    wanted_ += std::chrono::steady_clock::now() - since_;
    had_ += thread_cpu_time() - cpu_since_;
  }

  // How long to stand aside now (zero: go on helping); looks at the clocks once per kWatchEvery at most.
  std::chrono::nanoseconds verdict() {
    const auto now = std::chrono::steady_clock::now();
    if (!wanting_ || now - since_ < kWatchEvery) return std::chrono::nanoseconds(0);
    rest();
    want();
    if (wanted_ < kWatchWindow) return std::chrono::nanoseconds(0);
    const bool crowded = static_cast<double>(had_.count()) < kMinCoreShare * static_cast<double>(wanted_.count());
    wanted_ = had_ = std::chrono::nanoseconds(0);
    if (!crowded) {
      next_rest_ = kFirstRest;
      return std::chrono::nanoseconds(0);
    }
    const std::chrono::nanoseconds rest = next_rest_;
    next_rest_ = std::min<std::chrono::nanoseconds>(2 * next_rest_, kLongestRest);
    return rest;
  }

 private:
  bool wanting_ = false;
  std::chrono::steady_clock::time_point since_;
  std::chrono::nanoseconds cpu_since_{0}, wanted_{0}, had_{0};
  std::chrono::nanoseconds next_rest_ = kFirstRest;
};

struct Call {
  void (*work)(const void*, int64_t);
  const void* context;
  int64_t slots;
  std::atomic<int64_t> next_slot{1};  // slot 0 is the caller's
  std::atomic<bool> failed{false};
  std::exception_ptr error;  // a helper's, set once by the one that set `failed`
};

thread_local bool tls_in_work = false;

// One per process, never destroyed: its helpers are detached and sleep on its words until the process exits.
class Team {
 public:
  static Team& get() {
    static Team* team = [] {
      auto* made = new Team();
      made->set_threads(at::get_num_threads());  // torch's count until the owner sets one
      pthread_atfork(nullptr, nullptr, [] { Team::get().forget_helpers(); });
      return made;
    }();
    return *team;
  }

  int64_t threads() const { return threads_.load(std::memory_order_relaxed); }

  int64_t rests() const { return rests_.load(std::memory_order_relaxed); }

  void set_threads(int64_t threads) {
    threads_.store(std::max<int64_t>(1, std::min(threads, kMaxHelpers + 1)), std::memory_order_relaxed);
    roster_.fetch_add(1, std::memory_order_seq_cst);  // helpers past the new count sleep; the others wake
    futex_wake_all(roster_);
  }

  void run(int64_t slots, void (*work)(const void*, int64_t), const void* context) {
    const int64_t helpers = std::min(slots, threads()) - 1;
    bool expected = false;
    if (helpers <= 0 || tls_in_work || !busy_.compare_exchange_strong(expected, true, std::memory_order_acquire)) {
      run_here(work, context, 0);  // one thread, work inside work, or another thread's call under way
      return;
    }
    if (!start_helpers(helpers) && started_ == 0) {  // no thread could be made (a container's pid limit): alone
      busy_.store(false, std::memory_order_release);
      run_here(work, context, 0);
      return;
    }
    Call call{work, context, slots};
    call_.store(&call, std::memory_order_seq_cst);
    epoch_.fetch_add(1, std::memory_order_seq_cst);
    if (sleepers_.load(std::memory_order_seq_cst) > 0) futex_wake_all(epoch_);
    try {
      run_here(work, context, 0);
    } catch (...) {
      end_call();
      throw;
    }
    end_call();
    if (call.failed.load(std::memory_order_acquire)) std::rethrow_exception(call.error);
  }

 private:
  static void run_here(void (*work)(const void*, int64_t), const void* context, int64_t slot) {
    c10::ParallelGuard guard(true);  // as in the helpers: torch's parallel_for inside the work runs on this thread
    const bool outer = tls_in_work;
    tls_in_work = true;
    try {
      work(context, slot);
    } catch (...) {
      tls_in_work = outer;
      throw;
    }
    tls_in_work = outer;
  }

  // No helper joins the call after this; one inside (it read `call_` after saying so) is waited for.
  void end_call() {
    call_.store(nullptr, std::memory_order_seq_cst);
    if (!spin_until([&] { return inside_.load(std::memory_order_seq_cst) == 0; }, kCallerSpin)) {
      caller_waiting_.store(1, std::memory_order_seq_cst);
      for (uint32_t inside; (inside = inside_.load(std::memory_order_seq_cst)) != 0;) futex_wait(inside_, inside);
      caller_waiting_.store(0, std::memory_order_relaxed);
    }
    busy_.store(false, std::memory_order_release);
  }

  // Starts helpers up to `helpers`; false when the OS would not make one (the call then uses those there are).
  bool start_helpers(int64_t helpers) {
    for (; started_ < helpers; ++started_) {
      const int64_t index = started_;
      try {
        std::thread([this, index] { serve(index); }).detach();
      } catch (const std::system_error&) {
        return false;
      }
    }
    return true;
  }

  // In a child made by fork: the parent's helpers are not there, and no call is under way on this thread.
  void forget_helpers() {
    started_ = 0;
    call_.store(nullptr);
    inside_.store(0);
    sleepers_.store(0);
    caller_waiting_.store(0);
    busy_.store(false);
  }

  // Helper `index`'s life: wait for a call, join it if it still wants a thread, leave, and again; stand aside a while
  // when it keeps losing its core (CoreWatch).
  [[noreturn]] void serve(int64_t index) {
    pthread_setname_np(pthread_self(), "specserve-team");
    c10::ParallelGuard guard(true);  // torch's parallel_for inside the work runs on this thread alone
    tls_in_work = true;
    CoreWatch watch;
    uint32_t seen = epoch_.load(std::memory_order_seq_cst);
    for (;;) {
      const uint32_t roster = roster_.load(std::memory_order_seq_cst);
      if (index + 1 >= threads()) {  // not one of the current count's helpers
        watch.rest();
        futex_wait(roster_, roster);
        continue;
      }
      if (const auto rest = watch.verdict(); rest.count() > 0) {
        watch.rest();
        rests_.fetch_add(1, std::memory_order_relaxed);
        futex_wait_for(roster_, roster, rest);  // calls meanwhile run without this helper
        seen = epoch_.load(std::memory_order_seq_cst);
        continue;
      }
      watch.want();
      if (!spin_until([&] { return epoch_.load(std::memory_order_relaxed) != seen; }, kHelperSpin)) {
        watch.rest();
        sleepers_.fetch_add(1, std::memory_order_seq_cst);
        if (epoch_.load(std::memory_order_seq_cst) == seen && roster_.load(std::memory_order_seq_cst) == roster) {
          futex_wait(epoch_, seen);
        }
        sleepers_.fetch_sub(1, std::memory_order_seq_cst);
        watch.want();
      }
      seen = epoch_.load(std::memory_order_seq_cst);
      join();
    }
  }

  // Joins the call under way, if any still has a slot free.
  void join() {
    inside_.fetch_add(1, std::memory_order_seq_cst);  // before reading `call_`: the caller then waits for this one
    if (Call* call = call_.load(std::memory_order_seq_cst)) {
      const int64_t slot = call->next_slot.fetch_add(1, std::memory_order_relaxed);
      if (slot < call->slots) {
        try {
          call->work(call->context, slot);
        } catch (...) {  // the items it held are left undone: the caller raises this instead of returning
          if (!call->failed.exchange(true, std::memory_order_acq_rel)) call->error = std::current_exception();
        }
      }
    }
    if (inside_.fetch_sub(1, std::memory_order_seq_cst) == 1 && caller_waiting_.load(std::memory_order_seq_cst)) {
      futex_wake_all(inside_);
    }
  }

  std::atomic<int64_t> threads_{1};
  int64_t started_ = 0;  // helpers started (by the caller holding busy_)
  std::atomic<bool> busy_{false};
  alignas(64) std::atomic<uint32_t> epoch_{0};  // one more for each call: the word helpers sleep on
  std::atomic<uint32_t> roster_{0};             // one more for each change of the count
  std::atomic<uint32_t> sleepers_{0};
  alignas(64) std::atomic<Call*> call_{nullptr};
  std::atomic<uint32_t> inside_{0};  // helpers that may be reading the call or doing its work
  std::atomic<uint32_t> caller_waiting_{0};
  std::atomic<int64_t> rests_{0};  // times a helper stood aside (CoreWatch)
};

}  // namespace

int64_t team_threads() { return Team::get().threads(); }

void set_team_threads(int64_t threads) { Team::get().set_threads(threads); }

bool in_team_work() { return tls_in_work; }

int64_t team_rests() { return Team::get().rests(); }

void run_team_call(int64_t slots, void (*work)(const void*, int64_t), const void* context) {
  Team::get().run(slots, work, context);
}

}  // namespace specserve
