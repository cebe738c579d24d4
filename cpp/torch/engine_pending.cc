// Copyright tensorwire authors.
//
// TEMPORARY (built only while cpp/src/protocol/messenger.cc is absent, i.e.
// until the C++ message engine of issue 48 item 1 lands): a stand-in
// Messenger whose messages travel through the group's c10d store, so the
// backend's multi-rank semantics can be tested against gloo before the
// engine exists. Slow (every message is a store key, polled); no peer
// failure detection (a dead peer is a timeout). Not for use.
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <chrono>
#include <cstring>
#include <deque>
#include <mutex>
#include <thread>

#include "core/request_state.h"
#include "tensorwire/messenger.h"

namespace tensorwire {

std::unique_ptr<Messenger> make_messenger(Device&, int, int, Rendezvous&, const MessengerConfig&) {
  throw ConnectionError("this build has no message engine yet (issue 48 item 1)");
}

namespace torch_backend {

class StoreMessenger : public Messenger {
 public:
  StoreMessenger(c10::intrusive_ptr<c10d::Store> store, int rank, int size, double timeout_s, std::string name)
      : store_(std::move(store)), rank_(rank), size_(size), timeout_(timeout_s), name_(std::move(name)),
        sent_(size, 0), next_(size, 0) {
    reader_ = std::thread([this] { read_loop(); });
  }
  ~StoreMessenger() override { close(); }
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  double timeout() const override { return timeout_; }
  MessengerStats stats() const override { return {}; }

  Request isend(const Buffer& b, int peer, std::int64_t tag) override {
    if (peer < 0 || peer >= size_ || peer == rank_) throw InvalidArgument("bad peer " + std::to_string(peer));
    std::vector<uint8_t> v(8 + b.nbytes);
    std::memcpy(v.data(), &tag, 8);
    if (b.nbytes) std::memcpy(v.data() + 8, b.data, b.nbytes);
    std::uint64_t n;
    {
      std::lock_guard<std::mutex> lock(send_mu_);
      n = sent_[peer]++;
      store_->set(key(rank_, peer, n), v);
    }
    return Request();
  }

  Request irecv(const Buffer& b, int peer, std::int64_t tag, int* source) override {
    std::lock_guard<std::mutex> lock(mu_);
    if (closed_) throw ConnectionError("closed");
    for (auto it = unexpected_.begin(); it != unexpected_.end(); ++it) {
      if ((peer == kAnySource || it->src == peer) && it->tag == tag) {
        Msg m = std::move(*it);
        unexpected_.erase(it);
        if (m.bytes.size() != b.nbytes) return Request::failed(ErrorKind::kInvalidArgument, sizes(m, b));
        if (b.nbytes) std::memcpy(b.data, m.bytes.data(), b.nbytes);
        if (source) *source = m.src;
        return Request();
      }
    }
    auto* s = new detail::RequestState(nullptr, 2);
    posted_.push_back(Posted{peer, tag, b, source, s});
    return Request(s);
  }

  void close() override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (closed_) return;
      closed_ = true;
      for (auto& p : posted_) {
        p.state->complete_error(ErrorKind::kConnection, "messenger closed");
        p.state->release();
      }
      posted_.clear();
    }
    if (reader_.joinable()) reader_.join();
  }

 private:
  struct Msg {
    int src;
    std::int64_t tag;
    std::vector<uint8_t> bytes;
  };
  struct Posted {
    int src;
    std::int64_t tag;
    Buffer buf;
    int* source;
    detail::RequestState* state;
  };
  std::string key(int src, int dst, std::uint64_t n) const {
    return name_ + "/m/" + std::to_string(src) + "/" + std::to_string(dst) + "/" + std::to_string(n);
  }
  static std::string sizes(const Msg& m, const Buffer& b) {
    return "sizes differ: rank " + std::to_string(m.src) + " sent " + std::to_string(m.bytes.size()) +
           " B, the receive expects " + std::to_string(b.nbytes) + " B";
  }
  void read_loop() {
    for (;;) {
      {
        std::lock_guard<std::mutex> lock(mu_);
        if (closed_) return;
      }
      bool any = false;
      for (int p = 0; p < size_; ++p) {
        if (p == rank_) continue;
        std::string k = key(p, rank_, next_[p]);
        try {
          if (!store_->check({k})) continue;
          auto v = store_->get(k);
          store_->deleteKey(k);
          ++next_[p];
          any = true;
          Msg m{p, 0, {}};
          std::memcpy(&m.tag, v.data(), 8);
          m.bytes.assign(v.begin() + 8, v.end());
          deliver(std::move(m));
        } catch (const std::exception&) {
          std::this_thread::sleep_for(std::chrono::milliseconds(10));
        }
      }
      if (!any) std::this_thread::sleep_for(std::chrono::microseconds(500));
    }
  }
  void deliver(Msg m) {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto it = posted_.begin(); it != posted_.end(); ++it) {
      if ((it->src == kAnySource || it->src == m.src) && it->tag == m.tag) {
        Posted p = *it;
        posted_.erase(it);
        if (m.bytes.size() != p.buf.nbytes) {
          p.state->complete_error(ErrorKind::kInvalidArgument, sizes(m, p.buf));
        } else {
          if (p.buf.nbytes) std::memcpy(p.buf.data, m.bytes.data(), p.buf.nbytes);
          if (p.source) *p.source = m.src;
          p.state->complete_ok();
        }
        p.state->release();
        return;
      }
    }
    unexpected_.push_back(std::move(m));
  }

  c10::intrusive_ptr<c10d::Store> store_;
  const int rank_, size_;
  const double timeout_;
  const std::string name_;
  std::mutex send_mu_, mu_;
  std::vector<std::uint64_t> sent_, next_;
  std::deque<Msg> unexpected_;
  std::deque<Posted> posted_;
  bool closed_ = false;
  std::thread reader_;
};

std::unique_ptr<Messenger> make_store_messenger(c10::intrusive_ptr<c10d::Store> store, int rank, int size,
                                                double timeout_s, const std::string& name) {
  return std::make_unique<StoreMessenger>(std::move(store), rank, size, timeout_s, name);
}

}  // namespace torch_backend
}  // namespace tensorwire
