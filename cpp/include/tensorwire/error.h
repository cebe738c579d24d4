// Copyright tensorwire authors. The one error hierarchy of tensorwire.
//
// Setup and control paths throw these; the data path returns a Request whose
// wait() throws them. The Python bindings map each class once to a Python type.
#pragma once

#include <stdexcept>
#include <string>

namespace tensorwire {

enum class ErrorKind {
  kGeneric,
  kInvalidArgument,   // bad range, bad shape, bad option: nothing was posted
  kTimeout,           // a wait ran past its deadline; the operation may still complete
  kConnection,        // cannot reach a peer, or the device/channel is closed
  kPeerFailed,        // the peer died or disconnected; pending work on it failed
  kPoolExhausted,     // the registered memory pool has no room within its limit
  kProtocolMismatch,  // peer speaks another protocol or format version
  kNotFound,          // named region or call handler unknown to the peer
};

class Error : public std::runtime_error {
 public:
  Error(ErrorKind kind, const std::string& what, int ucx_status = 0)
      : std::runtime_error(what), kind_(kind), ucx_status_(ucx_status) {}
  ErrorKind kind() const noexcept { return kind_; }
  // The UCX ucs_status_t behind the error, 0 when none.
  int ucx_status() const noexcept { return ucx_status_; }

 private:
  ErrorKind kind_;
  int ucx_status_;
};

#define TW_DEFINE_ERROR(Name, Kind)                                                                          \
  class Name : public Error {                                                                                \
   public:                                                                                                   \
    explicit Name(const std::string& what, int ucx_status = 0) : Error(ErrorKind::Kind, what, ucx_status) {} \
  };

TW_DEFINE_ERROR(InvalidArgument, kInvalidArgument)
TW_DEFINE_ERROR(Timeout, kTimeout)
TW_DEFINE_ERROR(ConnectionError, kConnection)
TW_DEFINE_ERROR(PeerFailed, kPeerFailed)
TW_DEFINE_ERROR(PoolExhausted, kPoolExhausted)
TW_DEFINE_ERROR(ProtocolMismatch, kProtocolMismatch)
TW_DEFINE_ERROR(NotFound, kNotFound)
#undef TW_DEFINE_ERROR

// Throws the subclass of Error that matches `kind`.
[[noreturn]] void throw_error(ErrorKind kind, const std::string& what, int ucx_status = 0);

}  // namespace tensorwire
