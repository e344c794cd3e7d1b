// Cost of one heartbeat from C++: the median over repeated batches of ns per beat, beside the
// clock read it contains. Prints one JSON object.
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <string>
#include <vector>

#include "elastic/heartbeat.hpp"

int main(int argc, char** argv) {
  long beats = argc > 1 ? std::stol(argv[1]) : 2000000;
  const int batches = 15;
  std::string path = "/dev/shm/elastic-bench-beat-" + std::to_string(::getpid());
  elastic::HeartbeatTable table = elastic::HeartbeatTable::create(path, 1);
  elastic::Heartbeat hb = elastic::Heartbeat::attach(path, 0);

  auto median_ns = [&](auto&& body) {
    std::vector<double> per;
    for (int b = 0; b < batches; ++b) {
      uint64_t t0 = elastic::now_ns();
      for (long i = 0; i < beats; ++i) body();
      uint64_t t1 = elastic::now_ns();
      per.push_back(double(t1 - t0) / double(beats));
    }
    std::sort(per.begin(), per.end());
    return per[per.size() / 2];
  };
  volatile uint64_t sink = 0;
  double clock_ns = median_ns([&] { sink = sink + elastic::now_ns(); });
  double beat_ns = median_ns([&] { hb.beat(); });
  double step_ns = median_ns([&] { hb.beat(42); });
  std::printf("{\"beat_ns\": %.2f, \"beat_step_ns\": %.2f, \"clock_ns\": %.2f, \"steps\": %llu}\n",
              beat_ns, step_ns, clock_ns,
              static_cast<unsigned long long>(table.read(0).step));
  return 0;
}
