// Round trip of the shared-memory barrier: N forked processes pass R rounds; reports the median
// over repeats of (wall time / R). Prints one JSON object.
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <string>
#include <vector>

#include "elastic/barrier.hpp"

int main(int argc, char** argv) {
  int parties = argc > 1 ? std::stoi(argv[1]) : 2;
  int rounds = argc > 2 ? std::stoi(argv[2]) : 20000;
  int repeats = argc > 3 ? std::stoi(argv[3]) : 5;
  std::string path = "/dev/shm/elastic-bench-barrier-" + std::to_string(::getpid());
  elastic::LocalBarrier owner = elastic::LocalBarrier::create(path, static_cast<uint32_t>(parties));
  std::vector<double> per_round_ns;
  for (int rep = 0; rep < repeats; ++rep) {
    std::vector<pid_t> kids;
    int fds[2];
    if (::pipe(fds) != 0) return 1;
    for (int i = 0; i < parties; ++i) {
      pid_t pid = ::fork();
      if (pid == 0) {
        elastic::LocalBarrier b = elastic::LocalBarrier::open(path, static_cast<uint32_t>(i));
        b.wait(60000);  // warm-up round: everyone is running
        uint64_t t0 = elastic::now_ns();
        for (int r = 0; r < rounds; ++r) b.wait(60000);
        uint64_t t1 = elastic::now_ns();
        if (i == 0) {
          double ns = double(t1 - t0) / rounds;
          ssize_t w = ::write(fds[1], &ns, sizeof(ns));
          (void)w;
        }
        ::_exit(0);
      }
      kids.push_back(pid);
    }
    double ns = 0;
    ssize_t got = ::read(fds[0], &ns, sizeof(ns));
    for (pid_t k : kids) {
      int st;
      ::waitpid(k, &st, 0);
    }
    ::close(fds[0]);
    ::close(fds[1]);
    if (got == sizeof(ns)) per_round_ns.push_back(ns);
    owner.reset();
  }
  std::sort(per_round_ns.begin(), per_round_ns.end());
  std::printf("{\"parties\": %d, \"rounds\": %d, \"round_ns\": %.1f, \"min_round_ns\": %.1f}\n",
              parties, rounds, per_round_ns[per_round_ns.size() / 2], per_round_ns.front());
  return 0;
}
