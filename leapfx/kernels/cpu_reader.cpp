// The disk tier's reader for CPU expert offload: preadv jobs on C++ threads that never take the
// GIL (see leapfx/kernels/cpu_reader.py and leapfx/runtime/offload/engine.py's NativeEngine).
//
// A Python worker thread reading experts makes every torch call of the computing thread slower:
// each torch op releases the GIL, the waiting worker takes it, and the computing thread waits
// for a context switch to get it back (measured: RMSNorm 5 -> 9 us, SDPA 22 -> 34 us per call
// while prefetching). Here the workers are std::threads that see only integers: a job is a list
// of reads, each (layer, expert, fd, file offset, expected bytes, [(destination, bytes), ...]),
// one preadv each, straight into the slot's memory. Python holds the job's tensors until the
// job is taken, so the destinations stay valid.
//
// leapfx_cpu.Reader(delay_ns):
//   submit(demand, spec) -> ticket   spec: the reads flattened (see parse below); queued on the
//                                    demand or the prefetch worker, each first come first served
//   run(spec) -> ticket              the reads on the calling thread, now (inline demand)
//   done(ticket) -> bool             a poll
//   wait(ticket)                     blocks until done
//   take(ticket) -> (bytes, error, times)   the result, once: bytes read, "" or the error,
//                                    [start, end] ns per read on CLOCK_MONOTONIC (the clock of
//                                    Python's time.perf_counter on Linux)
//   busy_seconds() -> float          time the workers (and run) spent in jobs, summed
//   close()                          stops the workers after the jobs already queued
// delay_ns: a sleep before every job (tests: a compute that does not wait reads poisoned slots).
// torch releases the GIL around a custom-class method called from Python (its script-method
// call path), so wait and run block only the calling thread (tests/test_offload_native.py
// checks that another Python thread runs meanwhile).

#include <torch/custom_class.h>
#include <torch/library.h>

#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <mutex>
#include <string>
#include <thread>
#include <tuple>
#include <unordered_map>
#include <vector>

namespace {

int64_t now_ns() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return int64_t(ts.tv_sec) * 1000000000 + ts.tv_nsec;
}

struct Read {
  int64_t layer, expert, fd, offset, expect;
  std::vector<iovec> iov;
};

struct Result {
  bool done = false;
  int64_t moved = 0;
  std::string error;
  std::vector<int64_t> times;
};

// spec: per read [layer, expert, fd, offset, expected bytes, n, ptr_0, bytes_0, ...,
// ptr_{n-1}, bytes_{n-1}]
std::vector<Read> parse(const std::vector<int64_t>& spec) {
  std::vector<Read> reads;
  size_t i = 0;
  while (i < spec.size()) {
    TORCH_CHECK(i + 6 <= spec.size(), "leapfx_cpu.Reader: truncated read spec at ", i);
    Read r{spec[i], spec[i + 1], spec[i + 2], spec[i + 3], spec[i + 4], {}};
    const int64_t n = spec[i + 5];
    i += 6;
    TORCH_CHECK(n >= 1 && n <= IOV_MAX && i + 2 * size_t(n) <= spec.size(),
                "leapfx_cpu.Reader: bad buffer count ", n, " for expert ", r.expert,
                " of layer ", r.layer);
    for (int64_t b = 0; b < n; ++b, i += 2) {
      r.iov.push_back({reinterpret_cast<void*>(spec[i]), size_t(spec[i + 1])});
    }
    reads.push_back(std::move(r));
  }
  return reads;
}

// Runs one job's reads; touches no Python object and takes no lock.
void execute(const std::vector<Read>& reads, int64_t delay_ns, Result& out) {
  if (delay_ns > 0) std::this_thread::sleep_for(std::chrono::nanoseconds(delay_ns));
  for (const Read& r : reads) {
    const int64_t start = now_ns();
    ssize_t n;
    do {
      n = preadv(int(r.fd), r.iov.data(), int(r.iov.size()), off_t(r.offset));
    } while (n < 0 && errno == EINTR);
    out.times.push_back(start);
    out.times.push_back(now_ns());
    if (n < 0) {
      const int err = errno;
      out.error = "reading expert " + std::to_string(r.expert) + " of layer " +
                  std::to_string(r.layer) + " (fd " + std::to_string(r.fd) + ", offset " +
                  std::to_string(r.offset) + "): " + std::strerror(err) + " (errno " +
                  std::to_string(err) + ")";
      return;
    }
    if (n != r.expect) {
      out.error = "short read of expert " + std::to_string(r.expert) + " of layer " +
                  std::to_string(r.layer) + ": " + std::to_string(n) + " of " +
                  std::to_string(r.expect) + " bytes at offset " + std::to_string(r.offset) +
                  " (fd " + std::to_string(r.fd) + ")";
      return;
    }
    out.moved += n;
  }
}

class Reader : public torch::CustomClassHolder {
 public:
  explicit Reader(int64_t delay_ns) : delay_ns_(delay_ns) {
    for (int w = 0; w < 2; ++w) workers_[w] = std::thread([this, w] { work(w); });
  }

  ~Reader() override { close(); }

  int64_t submit(bool demand, const std::vector<int64_t>& spec) {
    std::vector<Read> reads = parse(spec);
    std::lock_guard<std::mutex> lock(mu_);
    TORCH_CHECK(!stopping_, "leapfx_cpu.Reader: submit after close");
    const int64_t ticket = next_++;
    results_[ticket];
    queues_[demand ? 0 : 1].push_back({ticket, std::move(reads)});
    work_cv_.notify_all();
    return ticket;
  }

  int64_t run(const std::vector<int64_t>& spec) {
    std::vector<Read> reads = parse(spec);
    Result result;
    const int64_t start = now_ns();
    execute(reads, delay_ns_, result);
    busy_ns_ += now_ns() - start;
    result.done = true;
    std::lock_guard<std::mutex> lock(mu_);
    const int64_t ticket = next_++;
    results_[ticket] = std::move(result);
    return ticket;
  }

  bool done(int64_t ticket) {
    std::lock_guard<std::mutex> lock(mu_);
    return find(ticket).done;
  }

  void wait(int64_t ticket) {
    std::unique_lock<std::mutex> lock(mu_);
    Result& r = find(ticket);
    done_cv_.wait(lock, [&] { return r.done; });
  }

  std::tuple<int64_t, std::string, std::vector<int64_t>> take(int64_t ticket) {
    std::lock_guard<std::mutex> lock(mu_);
    Result& r = find(ticket);
    TORCH_CHECK(r.done, "leapfx_cpu.Reader: take(", ticket, ") before the job is done");
    auto out = std::make_tuple(r.moved, std::move(r.error), std::move(r.times));
    results_.erase(ticket);
    return out;
  }

  double busy_seconds() const { return double(busy_ns_.load()) * 1e-9; }

  void close() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (stopping_) return;
      stopping_ = true;
      work_cv_.notify_all();
    }
    for (auto& t : workers_) {
      if (t.joinable()) t.join();
    }
  }

 private:
  struct Job {
    int64_t ticket;
    std::vector<Read> reads;
  };

  Result& find(int64_t ticket) {
    auto it = results_.find(ticket);
    TORCH_CHECK(it != results_.end(), "leapfx_cpu.Reader: unknown ticket ", ticket,
                " (never submitted, or already taken)");
    return it->second;
  }

  void work(int w) {
    for (;;) {
      Job job;
      {
        std::unique_lock<std::mutex> lock(mu_);
        work_cv_.wait(lock, [&] { return stopping_ || !queues_[w].empty(); });
        if (queues_[w].empty()) return;  // stopping, and the queue is drained
        job = std::move(queues_[w].front());
        queues_[w].pop_front();
      }
      Result result;
      const int64_t start = now_ns();
      execute(job.reads, delay_ns_, result);
      busy_ns_ += now_ns() - start;
      result.done = true;
      {
        std::lock_guard<std::mutex> lock(mu_);
        results_[job.ticket] = std::move(result);
      }
      done_cv_.notify_all();
    }
  }

  const int64_t delay_ns_;
  std::mutex mu_;
  std::condition_variable work_cv_, done_cv_;
  std::deque<Job> queues_[2];  // 0: demand, 1: prefetch
  std::unordered_map<int64_t, Result> results_;
  int64_t next_ = 0;
  bool stopping_ = false;
  std::atomic<int64_t> busy_ns_{0};
  std::thread workers_[2];
};

}  // namespace

TORCH_LIBRARY_FRAGMENT(leapfx_cpu, m) {
  m.class_<Reader>("Reader")
      .def(torch::init<int64_t>())
      .def("submit", &Reader::submit)
      .def("run", &Reader::run)
      .def("done", &Reader::done)
      .def("wait", &Reader::wait)
      .def("take", &Reader::take)
      .def("busy_seconds", &Reader::busy_seconds)
      .def("close", &Reader::close);
}
