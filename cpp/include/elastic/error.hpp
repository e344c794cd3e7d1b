// elastic/error.hpp: the exception every C++ API function throws, carrying a C status code.
#pragma once

#include <stdexcept>
#include <string>

#include "elastic/elastic.h"

namespace elastic {

/// An error with the elastic_status it maps to in the C API. `what()` is the full message.
class Error : public std::runtime_error {
 public:
  Error(elastic_status status, const std::string& message)
      : std::runtime_error(message), status_(status) {}

  elastic_status status() const noexcept { return status_; }

  /// For ELASTIC_ERR_ABORTED and ELASTIC_ERR_TIMEOUT from a barrier, and ELASTIC_ERR_NETWORK from
  /// the TCP barrier: the participant or peer at fault, -1 if none.
  int culprit() const noexcept { return culprit_; }
  Error& with_culprit(int culprit) noexcept {
    culprit_ = culprit;
    return *this;
  }

 private:
  elastic_status status_;
  int culprit_ = -1;
};

/// Monotonic time in nanoseconds (CLOCK_MONOTONIC): the clock of every time the library reports.
uint64_t now_ns() noexcept;

}  // namespace elastic
