/*
 * elastic-consumer: a minimal supervisor on the ElasticCore C API, the starting point for a
 * custom scheduler. It runs a command, watches it with the watchdog (death through a pidfd, hang
 * through its heartbeat), and restarts it when it dies or hangs.
 *
 *   elastic-consumer [--hang-timeout MS] [--max-restarts N] [--grace MS] -- COMMAND [ARG...]
 *
 * The command finds its heartbeat slot in ELASTIC_HEARTBEAT_FILE / ELASTIC_HEARTBEAT_SLOT (for
 * Python: `elastic_core.beat()`; for C: elastic_heartbeat_create_from_env + elastic_heartbeat_beat)
 * and its attempt number in ELASTIC_RESTART_COUNT. A command that never beats is only watched
 * for death.
 *
 * Exit status: 0 when the command succeeds; when the restart budget is spent, the last attempt's
 * exit code, or 128 + signal; 2 for a usage error.
 */
#define _XOPEN_SOURCE 700
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/types.h>
#include <unistd.h>

#include "elastic/elastic.h"

static volatile sig_atomic_t g_signal = 0;

static void on_signal(int sig) { g_signal = sig; }

static int usage(const char* why, const char* value) {
  if (why != NULL) fprintf(stderr, "elastic-consumer: %s '%s'\n", why, value ? value : "");
  fprintf(stderr,
          "usage: elastic-consumer [--hang-timeout MS] [--max-restarts N] [--grace MS] "
          "-- COMMAND [ARG...]\n");
  return 2;
}

/* A non-negative integer, or -1 if `s` is not one. */
static long parse_count(const char* s) {
  char* end = NULL;
  long v;
  errno = 0;
  v = strtol(s, &end, 10);
  if (errno != 0 || end == s || *end != '\0' || v < 0) return -1;
  return v;
}

static pid_t spawn(char** argv, const char* table_path, int attempt) {
  pid_t pid = fork();
  if (pid == 0) {
    char count[16];
    setpgid(0, 0); /* its own process group: a stop reaches its children too */
    snprintf(count, sizeof(count), "%d", attempt);
    setenv(ELASTIC_ENV_HEARTBEAT_FILE, table_path, 1);
    setenv(ELASTIC_ENV_HEARTBEAT_SLOT, "0", 1);
    setenv("ELASTIC_RESTART_COUNT", count, 1);
    execvp(argv[0], argv);
    fprintf(stderr, "elastic-consumer: cannot run '%s': %s\n", argv[0], strerror(errno));
    _exit(127);
  }
  if (pid > 0) setpgid(pid, pid);
  return pid;
}

/* Stop the process group of `pid`: SIGTERM, `grace_ms` to exit, then SIGKILL. */
static void stop_group(elastic_watchdog* wd, pid_t pid, long grace_ms) {
  elastic_event ev;
  killpg(pid, SIGTERM);
  if (elastic_watchdog_next_event(wd, &ev, (int)grace_ms) == ELASTIC_OK &&
      ev.kind == ELASTIC_EVENT_EXITED && ev.pid == pid) {
    killpg(pid, SIGKILL); /* its children, if it left any */
    return;
  }
  killpg(pid, SIGKILL);
  while (elastic_watchdog_next_event(wd, &ev, 5000) == ELASTIC_OK) {
    if (ev.kind == ELASTIC_EVENT_EXITED && ev.pid == pid) return;
  }
}

int main(int argc, char** argv) {
  long hang_timeout_ms = 0, max_restarts = 3, grace_ms = 3000;
  int i, attempt, status = 1;
  char table_path[96];
  elastic_heartbeat_table* table = NULL;
  elastic_watchdog* wd = NULL;
  elastic_watchdog_options options;
  struct sigaction sa;

  for (i = 1; i < argc; ++i) {
    if (strcmp(argv[i], "--") == 0) {
      ++i;
      break;
    } else if (strcmp(argv[i], "--version") == 0) {
      printf("elastic-consumer (ElasticCore %s, ABI %d)\n", elastic_version(),
             elastic_abi_version());
      return 0;
    } else if (i + 1 < argc && strcmp(argv[i], "--hang-timeout") == 0) {
      if ((hang_timeout_ms = parse_count(argv[++i])) < 0)
        return usage("--hang-timeout needs milliseconds, got", argv[i]);
    } else if (i + 1 < argc && strcmp(argv[i], "--max-restarts") == 0) {
      if ((max_restarts = parse_count(argv[++i])) < 0)
        return usage("--max-restarts needs a count, got", argv[i]);
    } else if (i + 1 < argc && strcmp(argv[i], "--grace") == 0) {
      if ((grace_ms = parse_count(argv[++i])) < 0)
        return usage("--grace needs milliseconds, got", argv[i]);
    } else {
      return usage("unknown or incomplete option", argv[i]);
    }
  }
  if (i >= argc) return usage("no command after", "--");

  snprintf(table_path, sizeof(table_path), "/dev/shm/elastic-consumer-%d", (int)getpid());
  if (elastic_heartbeat_table_create(table_path, 1, &table) != ELASTIC_OK) {
    fprintf(stderr, "elastic-consumer: %s\n", elastic_last_error());
    return 1;
  }
  elastic_watchdog_options_init(&options);
  options.reap = 1; /* nobody else waits for our children */
  if (elastic_watchdog_create(&options, &wd) != ELASTIC_OK || elastic_watchdog_start(wd) != 0) {
    fprintf(stderr, "elastic-consumer: %s\n", elastic_last_error());
    elastic_heartbeat_table_destroy(table);
    return 1;
  }
  memset(&sa, 0, sizeof(sa));
  sa.sa_handler = on_signal;
  sigaction(SIGINT, &sa, NULL);
  sigaction(SIGTERM, &sa, NULL);

  for (attempt = 0; attempt <= max_restarts && g_signal == 0; ++attempt) {
    elastic_event ev;
    pid_t pid;
    int rc;
    elastic_heartbeat_table_reset(table);
    pid = spawn(argv + i, table_path, attempt);
    if (pid < 0) {
      fprintf(stderr, "elastic-consumer: fork failed: %s\n", strerror(errno));
      break;
    }
    if (elastic_watchdog_watch(wd, attempt, pid, table, 0, (uint64_t)hang_timeout_ms, -1) != 0) {
      fprintf(stderr, "elastic-consumer: %s\n", elastic_last_error());
      killpg(pid, SIGKILL);
      break;
    }
    fprintf(stderr, "elastic-consumer: attempt %d: started pid %d\n", attempt, (int)pid);
    for (;;) {
      rc = elastic_watchdog_next_event(wd, &ev, 100);
      if (rc == ELASTIC_OK) break;
      if (g_signal != 0) break;
    }
    if (rc != ELASTIC_OK) { /* a signal: pass it on, then stop */
      fprintf(stderr, "elastic-consumer: got signal %d, stopping pid %d\n", (int)g_signal,
              (int)pid);
      stop_group(wd, pid, grace_ms);
      status = 128 + g_signal;
      break;
    }
    fprintf(stderr, "elastic-consumer: attempt %d: %s %s\n", attempt,
            elastic_event_kind_name(ev.kind), ev.detail);
    if (ev.kind == ELASTIC_EVENT_EXITED) {
      killpg(pid, SIGKILL); /* anything it left behind in its group */
      status = ev.exit_code >= 0 ? ev.exit_code : 128 + ev.signal;
      if (status == 0) break;
    } else {
      stop_group(wd, pid, grace_ms);
      status = 1;
    }
    if (attempt < max_restarts) fprintf(stderr, "elastic-consumer: restarting\n");
  }
  if (status != 0 && attempt > max_restarts) {
    fprintf(stderr, "elastic-consumer: giving up after %ld restart(s)\n", max_restarts);
  }
  elastic_watchdog_destroy(wd);
  elastic_heartbeat_table_destroy(table);
  return status;
}
