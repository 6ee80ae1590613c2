// The asynchronous file I/O engine of megazero.ops._aio: ZeRO-Infinity-style offload of
// optimizer states to NVMe (megazero/ops/aio.py is its Python face and holds the fallback).
//
// A request moves the bytes of one CPU buffer to or from the byte range [offset, offset +
// nbytes) of one file. It is cut into block_size pieces that a small pool of named threads
// ("megazero-aio") runs with pread/pwrite loops (partial transfers continue, EINTR retries).
//
// O_DIRECT (when asked for): the request's body -- nbytes rounded down to kAlign -- goes
// through a file descriptor opened with O_DIRECT, provided the buffer address and the file
// offset are kAlign-aligned; the unaligned tail (nbytes % kAlign), and every request whose
// address or offset is not aligned, go through a buffered descriptor. kAlign equals the page
// size, so direct and buffered pieces never share a page. A filesystem refusing O_DIRECT at
// open (EINVAL, e.g. tmpfs) or at transfer (EINVAL) gets the buffered path, and the refusal
// is recorded per file. Writes create the file (never truncate); a read reaching end of file
// early fails (EIO, "unexpected end of file").
//
// Completion is tracked per request handle; the failure of the lowest-offset failing piece is
// kept (errno, its file offset, what failed). Buffers are raw addresses: no libtorch.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

namespace megazero_aio {

constexpr int64_t kAlign = 4096;
constexpr const char* kThreadName = "megazero-aio";

struct Failure {
  int err = 0;          // errno; 0 = success
  int64_t offset = 0;   // file offset where the failing piece (or the part left) started
  std::string what;     // the call and its context, e.g. "pwrite (O_DIRECT) of 1048576 bytes"
};

struct Request {
  bool write = false;
  std::string path;
  int fd_direct = -1;    // O_DIRECT descriptor of the body, or -1
  int fd_buffered = -1;  // buffered descriptor of the tail / whole request, or -1
  int pending = 0;       // pieces not finished (guarded by Engine::mu_)
  bool done = false;
  bool failed = false;
  Failure failure;
};

struct Piece {
  std::shared_ptr<Request> req;
  char* buf;
  int64_t len;
  int64_t offset;
  bool direct;
};

struct Counters {
  int64_t bytes_read = 0, bytes_written = 0, direct_bytes = 0, buffered_bytes = 0;
  int64_t requests = 0;
};

class Engine {
 public:
  Engine(int num_threads, int64_t block_size, bool direct);
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  // Queues the transfer; never throws for I/O problems (an open failure completes the
  // request at once with that failure). Returns the handle (> 0).
  int64_t submit(bool write, char* buf, int64_t nbytes, const std::string& path,
                 int64_t offset);
  // Blocks until the request is complete, forgets it and returns its failure (err 0: none).
  Failure wait(int64_t handle);
  // Blocks until every request is complete, forgets them all; returns the failed ones.
  std::vector<std::pair<int64_t, Failure>> wait_all();
  // wait_all, then stops and joins the threads (idempotent); submit afterwards throws.
  void close();

  Counters counters();
  std::map<std::string, std::string> direct_refused();
  int num_threads() const { return static_cast<int>(threads_.size()); }
  bool closed();

 private:
  void worker_loop(int index);
  void run_piece(const Piece& p);
  void finish_piece(const Piece& p, const Failure* failure, int64_t moved, bool direct);
  void refuse_direct(const std::string& path, const std::string& reason);
  void close_fds(Request& r);

  const int64_t block_size_;
  const bool direct_;
  std::mutex mu_;
  std::condition_variable work_cv_, done_cv_;
  std::deque<Piece> queue_;
  std::unordered_map<int64_t, std::shared_ptr<Request>> requests_;
  std::map<std::string, std::string> refused_;
  Counters counters_;
  int64_t next_handle_ = 1;
  bool stopping_ = false;
  std::vector<std::thread> threads_;
};

}  // namespace megazero_aio
