// The thread pool and the pread/pwrite loops of megazero.ops._aio (see aio_common.h).
#include <fcntl.h>
#include <pthread.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <stdexcept>

#include "aio_common.h"

namespace megazero_aio {

namespace {

constexpr size_t kRefusedCap = 256;  // files remembered in direct_refused()

std::string call_name(bool write, bool direct) {
  return std::string(write ? "pwrite" : "pread") + (direct ? " (O_DIRECT)" : "");
}

int open_flags(bool write) { return (write ? (O_WRONLY | O_CREAT) : O_RDONLY) | O_CLOEXEC; }

// Moves len bytes between buf and the file at offset, continuing partial transfers and
// retrying EINTR. A direct transfer stops early (returning what it moved, no failure) when a
// partial transfer leaves it off the kAlign grid or the kernel refuses it with EINVAL
// (*refused set): the caller finishes the rest through a buffered descriptor.
int64_t transfer(bool write, int fd, char* buf, int64_t len, int64_t offset, bool direct,
                 Failure* failure, bool* refused) {
  int64_t done = 0;
  while (done < len) {
    if (direct && done % kAlign != 0) return done;
    const size_t want = static_cast<size_t>(std::min<int64_t>(len - done, int64_t{1} << 30));
    const ssize_t r = write ? ::pwrite(fd, buf + done, want, offset + done)
                            : ::pread(fd, buf + done, want, offset + done);
    if (r < 0) {
      if (errno == EINTR) continue;
      if (direct && errno == EINVAL) {
        *refused = true;
        return done;
      }
      *failure = {errno, offset + done,
                  call_name(write, direct) + " of " + std::to_string(len - done) + " bytes"};
      return done;
    }
    if (r == 0) {
      std::string what = call_name(write, direct) + " moved 0 of " +
                         std::to_string(len - done) + " bytes";
      struct stat st;
      if (!write && ::fstat(fd, &st) == 0) {
        what = "unexpected end of file (the file holds " + std::to_string(st.st_size) +
               " bytes; " + std::to_string(len - done) + " more were asked for)";
      }
      *failure = {EIO, offset + done, what};
      return done;
    }
    done += r;
  }
  return done;
}

}  // namespace

Engine::Engine(int num_threads, int64_t block_size, bool direct)
    : block_size_(block_size), direct_(direct) {
  if (num_threads < 1) throw std::invalid_argument("aio: num_threads must be >= 1");
  if (block_size < kAlign || block_size % kAlign != 0) {
    throw std::invalid_argument("aio: block_size must be a positive multiple of 4096");
  }
  threads_.reserve(num_threads);
  for (int i = 0; i < num_threads; ++i) {
    threads_.emplace_back(&Engine::worker_loop, this, i);
    // named here, not in the thread, so the name is in place when the constructor returns
    pthread_setname_np(threads_.back().native_handle(), kThreadName);
  }
}

Engine::~Engine() { close(); }

void Engine::worker_loop(int /*index*/) {
  for (;;) {
    Piece piece;
    {
      std::unique_lock<std::mutex> lock(mu_);
      work_cv_.wait(lock, [this] { return stopping_ || !queue_.empty(); });
      if (queue_.empty()) return;
      piece = std::move(queue_.front());
      queue_.pop_front();
    }
    run_piece(piece);
  }
}

void Engine::refuse_direct(const std::string& path, const std::string& reason) {
  std::lock_guard<std::mutex> lock(mu_);
  if (refused_.size() < kRefusedCap || refused_.count(path)) refused_[path] = reason;
}

void Engine::run_piece(const Piece& p) {
  Request& r = *p.req;
  Failure failure;
  bool refused = false;
  const int fd = p.direct ? r.fd_direct : r.fd_buffered;
  const int64_t direct_moved =
      transfer(r.write, fd, p.buf, p.len, p.offset, p.direct, &failure, &refused);
  int64_t buffered_moved = 0;
  if (p.direct && failure.err == 0 && direct_moved < p.len) {
    // O_DIRECT refused mid-request, or a partial transfer off the grid: the rest buffered
    if (refused) refuse_direct(r.path, call_name(r.write, true) + ": EINVAL");
    const int bfd = ::open(r.path.c_str(), open_flags(r.write), 0644);
    if (bfd < 0) {
      failure = {errno, p.offset + direct_moved, "open (buffered, after O_DIRECT stopped)"};
    } else {
      buffered_moved = transfer(r.write, bfd, p.buf + direct_moved, p.len - direct_moved,
                                p.offset + direct_moved, false, &failure, &refused);
      ::close(bfd);
    }
  }
  if (p.direct) {
    finish_piece(p, failure.err ? &failure : nullptr, direct_moved, true);
    if (buffered_moved) finish_piece(p, nullptr, buffered_moved, false);
  } else {
    finish_piece(p, failure.err ? &failure : nullptr, direct_moved, false);
  }
  std::unique_lock<std::mutex> lock(mu_);
  if (--r.pending > 0) return;
  lock.unlock();
  close_fds(r);  // only the last piece gets here: no other thread touches the descriptors
  lock.lock();
  r.done = true;
  lock.unlock();
  done_cv_.notify_all();
}

void Engine::finish_piece(const Piece& p, const Failure* failure, int64_t moved, bool direct) {
  std::lock_guard<std::mutex> lock(mu_);
  Request& r = *p.req;
  (r.write ? counters_.bytes_written : counters_.bytes_read) += moved;
  (direct ? counters_.direct_bytes : counters_.buffered_bytes) += moved;
  if (failure && (!r.failed || failure->offset < r.failure.offset)) {
    r.failed = true;
    r.failure = *failure;
  }
}

void Engine::close_fds(Request& r) {
  for (int* fd : {&r.fd_direct, &r.fd_buffered}) {
    if (*fd < 0) continue;
    if (::close(*fd) != 0 && r.write && errno != EINTR) {
      std::lock_guard<std::mutex> lock(mu_);
      if (!r.failed) {
        r.failed = true;
        r.failure = {errno, 0, "close after writing"};
      }
    }
    *fd = -1;
  }
}

int64_t Engine::submit(bool write, char* buf, int64_t nbytes, const std::string& path,
                       int64_t offset) {
  if (nbytes < 0 || offset < 0) throw std::invalid_argument("aio: negative size or offset");
  auto req = std::make_shared<Request>();
  req->write = write;
  req->path = path;
  int64_t body = 0;  // bytes through O_DIRECT, from the start
  const bool aligned = direct_ && nbytes >= kAlign && offset % kAlign == 0 &&
                       reinterpret_cast<uintptr_t>(buf) % kAlign == 0;
  if (aligned) {
    const int fd = ::open(path.c_str(), open_flags(write) | O_DIRECT, 0644);
    if (fd >= 0) {
      req->fd_direct = fd;
      body = nbytes - nbytes % kAlign;
    } else if (errno == EINVAL) {
      refuse_direct(path, "open with O_DIRECT: EINVAL (not supported by the filesystem)");
    } else {
      req->failed = true;
      req->failure = {errno, offset, write ? "open (O_DIRECT, create)" : "open (O_DIRECT)"};
    }
  }
  // an empty request still opens the file: a write creates it, a read checks it exists
  if (!req->failed && (body < nbytes || nbytes == 0)) {
    const int fd = ::open(path.c_str(), open_flags(write), 0644);
    if (fd >= 0) {
      req->fd_buffered = fd;
    } else {
      req->failed = true;
      req->failure = {errno, offset + body, write ? "open (create)" : "open"};
    }
  }
  std::vector<Piece> pieces;
  if (!req->failed) {
    for (int64_t at = 0; at < nbytes;) {
      const bool direct = at < body;
      const int64_t end = std::min(at + block_size_, direct ? body : nbytes);
      pieces.push_back({req, buf + at, end - at, offset + at, direct});
      at = end;
    }
  }
  std::unique_lock<std::mutex> lock(mu_);
  if (stopping_) {
    lock.unlock();
    close_fds(*req);
    throw std::runtime_error("aio: submit after close()");
  }
  const int64_t handle = next_handle_++;
  ++counters_.requests;
  req->pending = static_cast<int>(pieces.size());
  requests_[handle] = req;
  if (pieces.empty()) {
    lock.unlock();
    close_fds(*req);
    lock.lock();
    req->done = true;
    return handle;
  }
  for (auto& piece : pieces) queue_.push_back(std::move(piece));
  lock.unlock();
  work_cv_.notify_all();
  return handle;
}

Failure Engine::wait(int64_t handle) {
  std::unique_lock<std::mutex> lock(mu_);
  auto it = requests_.find(handle);
  if (it == requests_.end()) {
    throw std::out_of_range("aio: unknown or already waited handle " + std::to_string(handle));
  }
  std::shared_ptr<Request> req = it->second;
  done_cv_.wait(lock, [&req] { return req->done; });
  requests_.erase(handle);
  return req->failed ? req->failure : Failure{};
}

std::vector<std::pair<int64_t, Failure>> Engine::wait_all() {
  std::unique_lock<std::mutex> lock(mu_);
  done_cv_.wait(lock, [this] {
    return std::all_of(requests_.begin(), requests_.end(),
                       [](const auto& kv) { return kv.second->done; });
  });
  std::vector<std::pair<int64_t, Failure>> failed;
  for (const auto& kv : requests_) {
    if (kv.second->failed) failed.emplace_back(kv.first, kv.second->failure);
  }
  requests_.clear();
  std::sort(failed.begin(), failed.end(),
            [](const auto& a, const auto& b) { return a.first < b.first; });
  return failed;
}

void Engine::close() {
  wait_all();
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  work_cv_.notify_all();
  for (auto& t : threads_) {
    if (t.joinable()) t.join();
  }
  threads_.clear();
}

bool Engine::closed() {
  std::lock_guard<std::mutex> lock(mu_);
  return stopping_;
}

Counters Engine::counters() {
  std::lock_guard<std::mutex> lock(mu_);
  return counters_;
}

std::map<std::string, std::string> Engine::direct_refused() {
  std::lock_guard<std::mutex> lock(mu_);
  return refused_;
}

}  // namespace megazero_aio
