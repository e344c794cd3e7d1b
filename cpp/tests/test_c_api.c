/* The C API from plain C99 (compiled with -std=c99 -pedantic -Werror): status codes, the
 * per-thread error message, and a round trip through every kind of handle. Prints one line per
 * failed check and exits non-zero if any failed. */
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include "elastic/elastic.h"

static int failures = 0;

#define CHECK(cond)                                                   \
  do {                                                                \
    if (!(cond)) {                                                    \
      fprintf(stderr, "%s:%d: check failed: %s (last error: %s)\n", __FILE__, __LINE__, #cond, \
              elastic_last_error());                                  \
      ++failures;                                                     \
    }                                                                 \
  } while (0)

/* Options structs from older (smaller) and newer (larger) headers. The bytes past an old
 * struct are garbage that must not be read: here an impossible death_detection value. */
typedef struct old_options_v0 {
  uint32_t struct_size;
  uint64_t default_hang_timeout_ms;
} old_options_v0;

typedef struct old_options_v1 {
  uint32_t struct_size;
  uint64_t default_hang_timeout_ms;
  uint32_t hang_check_interval_ms;
  int32_t death_detection;
} old_options_v1;

static void check_struct_sizes(void) {
  union {
    elastic_watchdog_options current;
    old_options_v0 v0;
    old_options_v1 v1;
    unsigned char bytes[sizeof(elastic_watchdog_options) + 16];
  } buffer;
  elastic_watchdog* wd = NULL;

  memset(&buffer, 0x7f, sizeof buffer);
  buffer.v0.struct_size = sizeof(old_options_v0);
  buffer.v0.default_hang_timeout_ms = 0;
  CHECK(elastic_watchdog_create(&buffer.current, &wd) == ELASTIC_OK);
  CHECK(elastic_watchdog_death_detection(wd) == ELASTIC_DEATH_PIDFD); /* the default */
  elastic_watchdog_destroy(wd);

  memset(&buffer, 0x7f, sizeof buffer);
  buffer.v1.struct_size = sizeof(old_options_v1);
  buffer.v1.default_hang_timeout_ms = 0;
  buffer.v1.hang_check_interval_ms = 0;
  buffer.v1.death_detection = ELASTIC_DEATH_POLL;
  CHECK(elastic_watchdog_create(&buffer.current, &wd) == ELASTIC_OK);
  CHECK(elastic_watchdog_death_detection(wd) == ELASTIC_DEATH_POLL); /* a field it has */
  elastic_watchdog_destroy(wd);

  elastic_watchdog_options_init(&buffer.current);
  buffer.current.struct_size = (uint32_t)sizeof buffer.bytes; /* from a newer header */
  CHECK(elastic_watchdog_create(&buffer.current, &wd) == ELASTIC_ERR_INVALID_ARGUMENT);
  CHECK(strstr(elastic_last_error(), "newer elastic.h") != NULL);

  buffer.current.struct_size = 12; /* ends inside default_hang_timeout_ms */
  CHECK(elastic_watchdog_create(&buffer.current, &wd) == ELASTIC_ERR_INVALID_ARGUMENT);
  CHECK(strstr(elastic_last_error(), "inside the field default_hang_timeout_ms") != NULL);
}

int main(void) {
  char path[128];
  elastic_heartbeat_table* table = NULL;
  elastic_heartbeat* hb = NULL;
  elastic_slot_info info;
  elastic_watchdog* wd = NULL;
  elastic_watchdog_options options;
  elastic_event ev;
  elastic_barrier* barrier = NULL;
  elastic_gpu_health* gpu = NULL;
  pid_t child;
  int status;

  CHECK(elastic_abi_version() == ELASTIC_ABI_VERSION);
  CHECK(strlen(elastic_version()) > 0);
  CHECK(strcmp(elastic_status_name(ELASTIC_ERR_TIMEOUT), "ELASTIC_ERR_TIMEOUT") == 0);
  CHECK(strcmp(elastic_event_kind_name(ELASTIC_EVENT_HUNG), "HUNG") == 0);

  /* Errors: a status code and a message quoting the bad value. */
  CHECK(elastic_heartbeat_table_create("not/absolute", 2, &table) == ELASTIC_ERR_INVALID_ARGUMENT);
  CHECK(strstr(elastic_last_error(), "'not/absolute'") != NULL);
  CHECK(table == NULL);
  CHECK(elastic_heartbeat_create("/dev/shm/elastic-c-api-missing", 0, &hb) == ELASTIC_ERR_BAD_FILE);
  CHECK(strstr(elastic_last_error(), "does not exist") != NULL);
  CHECK(elastic_heartbeat_table_create(NULL, 2, &table) == ELASTIC_ERR_INVALID_ARGUMENT);
  CHECK(strstr(elastic_last_error(), "path must not be NULL") != NULL);

  /* Heartbeat round trip. */
  snprintf(path, sizeof(path), "/dev/shm/elastic-c-api-%d", (int)getpid());
  CHECK(elastic_heartbeat_table_create(path, 2, &table) == ELASTIC_OK);
  CHECK(elastic_heartbeat_table_capacity(table) == 2);
  CHECK(elastic_heartbeat_create(path, 1, &hb) == ELASTIC_OK);
  elastic_heartbeat_beat(hb);
  elastic_heartbeat_beat_step(hb, 41);
  CHECK(elastic_heartbeat_table_read(table, 1, &info) == ELASTIC_OK);
  CHECK(info.step == 41 && info.state == ELASTIC_SLOT_BEATING && info.pid == getpid());
  CHECK(elastic_heartbeat_table_read(table, 9, &info) == ELASTIC_ERR_INVALID_ARGUMENT);
  elastic_heartbeat_destroy(hb);

  /* Watchdog: a child killed by a signal. */
  elastic_watchdog_options_init(&options);
  CHECK(options.struct_size == sizeof(options));
  options.struct_size = 3;
  CHECK(elastic_watchdog_create(&options, &wd) == ELASTIC_ERR_INVALID_ARGUMENT);
  check_struct_sizes();
  elastic_watchdog_options_init(&options);
  CHECK(elastic_watchdog_create(&options, &wd) == ELASTIC_OK);
  CHECK(elastic_watchdog_death_detection(wd) == ELASTIC_DEATH_PIDFD);
  child = fork();
  if (child == 0) {
    pause();
    _exit(0);
  }
  CHECK(elastic_watchdog_watch(wd, 0, child, table, 1, 1000, -1) == ELASTIC_OK);
  CHECK(elastic_watchdog_start(wd) == ELASTIC_OK);
  CHECK(elastic_watchdog_next_event(wd, &ev, 50) == ELASTIC_ERR_TIMEOUT);
  kill(child, SIGTERM);
  CHECK(elastic_watchdog_next_event(wd, &ev, 5000) == ELASTIC_OK);
  CHECK(ev.kind == ELASTIC_EVENT_EXITED && ev.signal == SIGTERM && ev.pid == child);
  CHECK(strstr(ev.detail, "SIGTERM") != NULL);
  waitpid(child, &status, 0);
  CHECK(elastic_watchdog_unwatch(wd, 0) == ELASTIC_ERR_NOT_FOUND);
  CHECK(elastic_watchdog_stop(wd) == ELASTIC_OK);
  CHECK(elastic_watchdog_next_event(wd, &ev, -1) == ELASTIC_ERR_STATE);
  elastic_watchdog_destroy(wd);

  /* Barrier of one participant passes at once. */
  snprintf(path, sizeof(path), "/dev/shm/elastic-c-api-bar-%d", (int)getpid());
  {
    elastic_barrier* owner = NULL;
    CHECK(elastic_barrier_create(path, 1, &owner) == ELASTIC_OK);
    CHECK(elastic_barrier_open(path, 0, &barrier) == ELASTIC_OK);
    CHECK(elastic_barrier_wait(barrier, 1000) == ELASTIC_OK);
    CHECK(elastic_barrier_rounds(owner) == 1);
    CHECK(elastic_barrier_abort(owner, 0, "test abort") == ELASTIC_OK);
    CHECK(elastic_barrier_wait(barrier, 1000) == ELASTIC_ERR_ABORTED);
    CHECK(strstr(elastic_last_error(), "test abort") != NULL);
    elastic_barrier_destroy(barrier);
    elastic_barrier_destroy(owner);
  }

  /* GPU health without NVML: not available, not an error. */
  CHECK(elastic_gpu_health_create("/nonexistent/libnvidia-ml.so.1", 1000, &gpu) == ELASTIC_OK);
  CHECK(elastic_gpu_health_state(gpu) == ELASTIC_GPU_NOT_AVAILABLE);
  CHECK(strstr(elastic_gpu_health_detail(gpu), "could not be loaded") != NULL);
  elastic_gpu_health_destroy(gpu);

  elastic_heartbeat_table_destroy(table);
  CHECK(access(path, F_OK) != 0);
  elastic_heartbeat_table_destroy(NULL);
  elastic_watchdog_destroy(NULL);

  if (failures == 0) printf("C API checks passed\n");
  return failures == 0 ? 0 : 1;
}
