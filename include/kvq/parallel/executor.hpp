#pragma once
// Executor: the one seam through which decode attention runs work in parallel. An engine that
// owns a thread pool implements it; ThreadPool is the library's own. Work items are independent
// and their results are merged in a fixed order by the caller, so results never depend on which
// thread ran what or how many threads there are.

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <exception>
#include <mutex>
#include <string>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include "kvq/error.hpp"

namespace kvq::inline v0 {

/// A non-owning reference to a callable `void(std::size_t)`: no allocation, unlike std::function.
class TaskRef {
 public:
  template <class F>
  requires(!std::is_same_v<std::remove_cvref_t<F>, TaskRef> && std::is_invocable_v<F&, std::size_t>) TaskRef(F& f)
  noexcept  // NOLINT: implicit on purpose, like std::function_ref
      : object_(static_cast<void*>(std::addressof(f))),
        call_([](void* o, std::size_t i) { (*static_cast<F*>(o))(i); }) {}

  void operator()(std::size_t i) const { call_(object_, i); }

 private:
  void* object_;
  void (*call_)(void*, std::size_t);
};

class Executor {
 public:
  virtual ~Executor() = default;
  /// Threads that may run items at once (including the caller's).
  virtual std::size_t concurrency() const noexcept = 0;
  /// Runs task(0) .. task(n - 1), each exactly once, in any order and on any thread; returns when
  /// all have finished. The first exception a task throws is rethrown here.
  virtual void parallel_for(std::size_t n, TaskRef task) = 0;
};

/// Runs everything on the calling thread.
class SerialExecutor final : public Executor {
 public:
  std::size_t concurrency() const noexcept override { return 1; }
  void parallel_for(std::size_t n, TaskRef task) override {
    for (std::size_t i = 0; i < n; ++i) task(i);
  }
};

/// A fixed set of worker threads; the calling thread works too, so ThreadPool(2) uses two cores.
///
/// Threads: parallel_for may be called from any number of threads at once. Each call is a job
/// that its caller works on; idle workers join the oldest job that still has unclaimed items, so
/// independent callers neither wait for each other's jobs nor lose their own progress. A
/// parallel_for called from inside one of this pool's tasks (nested) runs its items inline on
/// that thread: the outer job already occupies the workers, and waiting for them there could
/// deadlock.
class ThreadPool final : public Executor {
 public:
  /// Most threads a pool starts.
  static constexpr std::size_t max_threads = 4096;

  /// Throws kvq::Error: invalid_argument above max_threads, out_of_memory when the system starts
  /// too few (the workers already started are stopped first).
  explicit ThreadPool(std::size_t threads = std::max(1u, std::thread::hardware_concurrency())) {
    if (threads > max_threads)
      throw Error(ErrorCode::invalid_argument,
                  "thread pool: " + std::to_string(threads) + " threads (at most " + std::to_string(max_threads) + ")");
    const std::size_t workers = std::max<std::size_t>(threads, 1) - 1;
    try {
      threads_.reserve(workers);
      for (std::size_t i = 0; i < workers; ++i) threads_.emplace_back([this] { work(); });
    } catch (const std::exception& e) {
      stop();  // the members' destructors would wait on running workers
      throw Error(ErrorCode::out_of_memory, "thread pool: started " + std::to_string(threads_.size()) + " of " +
                                                std::to_string(workers) + " workers (" + e.what() + ")");
    }
  }
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;
  ~ThreadPool() override { stop(); }

  std::size_t concurrency() const noexcept override { return threads_.size() + 1; }

  void parallel_for(std::size_t n, TaskRef task) override {
    if (n == 0) return;
    if (threads_.empty() || n == 1 || inside() == this) {
      for (std::size_t i = 0; i < n; ++i) task(i);
      return;
    }
    Job job(task, n);
    {
      std::lock_guard lock(mutex_);
      jobs_.push_back(&job);
    }
    wake_.notify_all();
    run_items(job);
    std::unique_lock lock(mutex_);
    // Every item is claimed; the job is done once no worker is still running one of them.
    done_.wait(lock, [&] { return job.workers == 0; });
    jobs_.erase(std::find(jobs_.begin(), jobs_.end(), &job));
    if (job.error) std::rethrow_exception(job.error);
  }

 private:
  void stop() noexcept {
    {
      std::lock_guard lock(mutex_);
      stop_ = true;
    }
    wake_.notify_all();
    for (auto& t : threads_) t.join();
  }

  struct Job {
    Job(TaskRef t, std::size_t n) : task(t), count(n) {}
    TaskRef task;
    const std::size_t count;
    std::atomic<std::size_t> next{0};
    std::size_t workers = 0;   // workers inside run_items (guarded by mutex_)
    std::exception_ptr error;  // the first exception (guarded by mutex_)

    bool claimable() const noexcept { return next.load(std::memory_order_relaxed) < count; }
  };

  /// The pool whose task this thread is running, if any.
  static const ThreadPool*& inside() noexcept {
    thread_local const ThreadPool* pool = nullptr;
    return pool;
  }

  void run_items(Job& job) {
    const ThreadPool* outer = std::exchange(inside(), this);
    for (;;) {
      const std::size_t i = job.next.fetch_add(1, std::memory_order_relaxed);
      if (i >= job.count) break;
      try {
        job.task(i);
      } catch (...) {
        std::lock_guard lock(mutex_);
        if (!job.error) job.error = std::current_exception();
      }
    }
    inside() = outer;
  }

  Job* claimable_job() const noexcept {
    for (Job* job : jobs_)
      if (job->claimable()) return job;
    return nullptr;
  }

  void work() {
    for (;;) {
      Job* job = nullptr;
      {
        std::unique_lock lock(mutex_);
        wake_.wait(lock, [&] { return stop_ || (job = claimable_job()) != nullptr; });
        if (stop_) return;
        ++job->workers;
      }
      run_items(*job);
      std::lock_guard lock(mutex_);
      if (--job->workers == 0) done_.notify_all();
    }
  }

  std::vector<std::thread> threads_;
  std::mutex mutex_;
  std::condition_variable wake_, done_;
  std::vector<Job*> jobs_;  // in submission order (guarded by mutex_)
  bool stop_ = false;
};

}  // namespace kvq::inline v0
