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
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

namespace kvq::inline v0 {

/// A non-owning reference to a callable `void(std::size_t)`: no allocation, unlike std::function.
class TaskRef {
 public:
  template <class F>
    requires(!std::is_same_v<std::remove_cvref_t<F>, TaskRef> && std::is_invocable_v<F&, std::size_t>)
  TaskRef(F& f) noexcept  // NOLINT: implicit on purpose, like std::function_ref
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
class ThreadPool final : public Executor {
 public:
  explicit ThreadPool(std::size_t threads = std::max(1u, std::thread::hardware_concurrency())) {
    const std::size_t workers = std::max<std::size_t>(threads, 1) - 1;
    threads_.reserve(workers);
    for (std::size_t i = 0; i < workers; ++i) threads_.emplace_back([this] { work(); });
  }
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;
  ~ThreadPool() override {
    {
      std::lock_guard lock(mutex_);
      stop_ = true;
    }
    wake_.notify_all();
    for (auto& t : threads_) t.join();
  }

  std::size_t concurrency() const noexcept override { return threads_.size() + 1; }

  void parallel_for(std::size_t n, TaskRef task) override {
    if (n == 0) return;
    if (threads_.empty() || n == 1) {
      for (std::size_t i = 0; i < n; ++i) task(i);
      return;
    }
    std::lock_guard serial(submit_);  // one job at a time; concurrent callers queue here
    {
      std::lock_guard lock(mutex_);
      task_ = &task;
      count_ = n;
      next_.store(0, std::memory_order_relaxed);
      active_ = threads_.size();
      error_ = nullptr;
      ++generation_;
    }
    wake_.notify_all();
    run_items();
    std::unique_lock lock(mutex_);
    done_.wait(lock, [&] { return active_ == 0; });
    task_ = nullptr;
    if (error_) std::rethrow_exception(std::exchange(error_, nullptr));
  }

 private:
  void run_items() {
    for (;;) {
      const std::size_t i = next_.fetch_add(1, std::memory_order_relaxed);
      if (i >= count_) return;
      try {
        (*task_)(i);
      } catch (...) {
        std::lock_guard lock(mutex_);
        if (!error_) error_ = std::current_exception();
      }
    }
  }

  void work() {
    std::size_t seen = 0;
    for (;;) {
      {
        std::unique_lock lock(mutex_);
        wake_.wait(lock, [&] { return stop_ || generation_ != seen; });
        if (stop_) return;
        seen = generation_;
      }
      run_items();
      std::lock_guard lock(mutex_);
      if (--active_ == 0) done_.notify_one();
    }
  }

  std::vector<std::thread> threads_;
  std::mutex submit_, mutex_;
  std::condition_variable wake_, done_;
  const TaskRef* task_ = nullptr;
  std::size_t count_ = 0, active_ = 0, generation_ = 0;
  std::atomic<std::size_t> next_{0};
  std::exception_ptr error_;
  bool stop_ = false;
};

}  // namespace kvq::inline v0
