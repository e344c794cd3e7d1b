/*
 * elastic.h: the stable C API of ElasticCore.
 *
 * ElasticCore is the native part of elasticrun: a shared-memory heartbeat table, a watchdog that
 * sees worker deaths (pidfd), hangs (stale heartbeats) and GPU faults (NVML, loaded at run time),
 * and barriers within a node (shared memory) and across nodes (TCP). This header is everything an
 * outside scheduler needs; it is plain C99 and has no dependency beyond libc.
 *
 * Conventions
 *   - Every symbol starts with `elastic_` (macros with `ELASTIC_`).
 *   - Objects are opaque handles made by `elastic_<thing>_create` (or `_open`) and released by
 *     `elastic_<thing>_destroy`, which accepts NULL.
 *   - Functions return an int status: ELASTIC_OK (0) or a negative `elastic_status` code. On
 *     failure, `elastic_last_error()` returns a message for the calling thread that quotes the bad
 *     value and says what to do. Output parameters are only written on success.
 *   - Times are CLOCK_MONOTONIC nanoseconds (`elastic_now_ns()`); timeouts are milliseconds, where
 *     a negative timeout means "wait without limit" only where a function says so.
 *   - Option structs carry their own size (`struct_size`) so that later versions can add fields
 *     without breaking callers compiled against this one; initialise them with the matching
 *     `*_options_init` function. A struct from an older header (a smaller size) works: the
 *     fields it lacks take their defaults. A size larger than the library's struct, or one that
 *     ends inside a field, is ELASTIC_ERR_INVALID_ARGUMENT.
 *   - Handles are not thread-safe unless a function says so. The watchdog runs its own thread and
 *     its functions may be called from any thread.
 */
#ifndef ELASTIC_ELASTIC_H
#define ELASTIC_ELASTIC_H

#include <stddef.h>
#include <stdint.h>

#if defined(ELASTIC_BUILDING_LIBRARY) || defined(ELASTIC_EXPORTS)
#define ELASTIC_API __attribute__((visibility("default")))
#else
#define ELASTIC_API
#endif

#ifdef __cplusplus
extern "C" {
#endif

/* ---------------------------------------------------------------------------------------------
 * Versions, status codes, errors
 * ------------------------------------------------------------------------------------------- */

/** Integer version of this C ABI. Bumped on any incompatible change (also the SOVERSION). */
#define ELASTIC_ABI_VERSION 1

/** Status codes. 0 is success, every error is negative. */
typedef enum elastic_status {
  ELASTIC_OK = 0,
  ELASTIC_ERR_INVALID_ARGUMENT = -1, /**< an argument is out of range or NULL */
  ELASTIC_ERR_SYSTEM = -2,           /**< a system call failed (errno in the message) */
  ELASTIC_ERR_BAD_FILE = -3,         /**< a shared-memory file is missing, foreign or damaged */
  ELASTIC_ERR_TIMEOUT = -4,          /**< a wait ran out of time */
  ELASTIC_ERR_ABORTED = -5,          /**< a barrier was aborted (a participant died or hung) */
  ELASTIC_ERR_NOT_FOUND = -6,        /**< no such worker, process or device */
  ELASTIC_ERR_STATE = -7,            /**< the call is not valid in the object's current state */
  ELASTIC_ERR_NETWORK = -8,          /**< a peer is unreachable or broke the protocol */
  ELASTIC_ERR_NOT_AVAILABLE = -9,    /**< a facility (NVML, pidfd) is not available here */
  ELASTIC_ERR_INTERNAL = -99         /**< a bug: please report it with the message */
} elastic_status;

/** The ABI version the library was built with (compare with ELASTIC_ABI_VERSION). */
ELASTIC_API int elastic_abi_version(void);

/** The library's release version, for example "0.1.0". Static storage. */
ELASTIC_API const char* elastic_version(void);

/** Message of the last failed call on this thread ("" if none). Valid until the next call. */
ELASTIC_API const char* elastic_last_error(void);

/** Short name of a status code, for example "ELASTIC_ERR_TIMEOUT". Static storage. */
ELASTIC_API const char* elastic_status_name(int status);

/** CLOCK_MONOTONIC in nanoseconds: the clock of every time this API reports. */
ELASTIC_API uint64_t elastic_now_ns(void);

/* ---------------------------------------------------------------------------------------------
 * Heartbeat table
 *
 * A file in shared memory (normally under /dev/shm) with a header and one cache-line slot per
 * local worker. The supervisor creates it; each worker attaches to its own slot and beats. A beat
 * writes the step counter and the time with plain atomic stores: no system call, no lock.
 * ------------------------------------------------------------------------------------------- */

/** Environment variable naming the heartbeat file, set by the launcher for each worker. */
#define ELASTIC_ENV_HEARTBEAT_FILE "ELASTIC_HEARTBEAT_FILE"
/** Environment variable with the worker's slot index in that file. */
#define ELASTIC_ENV_HEARTBEAT_SLOT "ELASTIC_HEARTBEAT_SLOT"

/** Largest number of slots a table may have. */
#define ELASTIC_HEARTBEAT_MAX_SLOTS 4096
/** Longest hang timeout a worker may ask for in its slot (7 days); a slot holding a longer one
 * was not written by the worker's library, and the watchdog reports it as broken. */
#define ELASTIC_HEARTBEAT_MAX_TIMEOUT_MS 604800000ull

/** State of a slot. */
typedef enum elastic_slot_state {
  ELASTIC_SLOT_EMPTY = 0,    /**< no worker has attached since the slot was reset */
  ELASTIC_SLOT_ATTACHED = 1, /**< a worker attached but has not beaten yet */
  ELASTIC_SLOT_BEATING = 2,  /**< the worker has beaten at least once */
  ELASTIC_SLOT_DETACHED = 3  /**< the worker detached cleanly (finished) */
} elastic_slot_state;

/** A snapshot of one slot. */
typedef struct elastic_slot_info {
  int32_t pid;           /**< pid of the attached worker, 0 if none */
  int32_t state;         /**< an elastic_slot_state */
  uint64_t step;         /**< step counter (the last value beaten) */
  uint64_t last_beat_ns; /**< time of the last beat (elastic_now_ns clock), 0 if never */
  uint64_t timeout_ms;   /**< the worker's own hang timeout, 0 if it set none */
} elastic_slot_info;

typedef struct elastic_heartbeat_table elastic_heartbeat_table;
typedef struct elastic_heartbeat elastic_heartbeat;

/**
 * Create a heartbeat table with `slots` empty slots at `path` (an absolute path, normally under
 * /dev/shm). Fails with ELASTIC_ERR_STATE if the file exists. The creator owns the file:
 * destroying the handle removes it.
 */
ELASTIC_API int elastic_heartbeat_table_create(const char* path, uint32_t slots,
                                               elastic_heartbeat_table** out);

/** Open an existing table for reading (a second supervisor, a monitoring tool). */
ELASTIC_API int elastic_heartbeat_table_open(const char* path, elastic_heartbeat_table** out);

/** Unmap the table; if this handle created the file, remove it too. NULL is allowed. */
ELASTIC_API void elastic_heartbeat_table_destroy(elastic_heartbeat_table* table);

/** Number of slots. */
ELASTIC_API uint32_t elastic_heartbeat_table_capacity(const elastic_heartbeat_table* table);

/** Generation: counts resets of the table, so that readers can tell restarts apart. */
ELASTIC_API uint64_t elastic_heartbeat_table_generation(const elastic_heartbeat_table* table);

/** Read a snapshot of slot `slot`. */
ELASTIC_API int elastic_heartbeat_table_read(const elastic_heartbeat_table* table, uint32_t slot,
                                             elastic_slot_info* out);

/** Empty one slot (before a new worker takes it). */
ELASTIC_API int elastic_heartbeat_table_reset_slot(elastic_heartbeat_table* table, uint32_t slot);

/** Empty every slot and bump the generation (before a restarted group attaches). */
ELASTIC_API int elastic_heartbeat_table_reset(elastic_heartbeat_table* table);

/**
 * Attach the calling process to slot `slot` of the table at `path`. A missing, foreign, truncated
 * or wrong-version file, or a slot out of range, is an error with a message saying which.
 */
ELASTIC_API int elastic_heartbeat_create(const char* path, uint32_t slot,
                                         elastic_heartbeat** out);

/**
 * Attach using ELASTIC_HEARTBEAT_FILE and ELASTIC_HEARTBEAT_SLOT. Returns ELASTIC_ERR_NOT_FOUND
 * (and leaves *out untouched) when the variables are not set: the process was not started by a
 * launcher that watches heartbeats.
 */
ELASTIC_API int elastic_heartbeat_create_from_env(elastic_heartbeat** out);

/** Mark the slot detached (a clean finish) and unmap. NULL is allowed. */
ELASTIC_API void elastic_heartbeat_destroy(elastic_heartbeat* hb);

/** Beat: advance the step counter by one and record the time. Lock-free, no system call. */
ELASTIC_API void elastic_heartbeat_beat(elastic_heartbeat* hb);

/** Beat with an explicit step counter. */
ELASTIC_API void elastic_heartbeat_beat_step(elastic_heartbeat* hb, uint64_t step);

/** Ask the watchdog to use this hang timeout for this worker (0 = the watchdog's own); longer
 * than ELASTIC_HEARTBEAT_MAX_TIMEOUT_MS is clamped to it. */
ELASTIC_API void elastic_heartbeat_set_timeout(elastic_heartbeat* hb, uint64_t timeout_ms);

/** The slot index this handle beats into. */
ELASTIC_API uint32_t elastic_heartbeat_slot(const elastic_heartbeat* hb);

/* ---------------------------------------------------------------------------------------------
 * GPU health (NVML, loaded with dlopen at run time)
 * ------------------------------------------------------------------------------------------- */

/** Environment variable overriding the NVML library path (default "libnvidia-ml.so.1"). */
#define ELASTIC_ENV_NVML_LIBRARY "ELASTIC_NVML_LIBRARY"

/** Overall state of NVML or of one device. */
typedef enum elastic_gpu_state {
  ELASTIC_GPU_HEALTHY = 0,
  ELASTIC_GPU_UNHEALTHY = 1,     /**< at least one fault bit is set */
  ELASTIC_GPU_UNKNOWN = 2,       /**< a check failed or did not return in time */
  ELASTIC_GPU_NOT_AVAILABLE = 3  /**< no NVML library (no NVIDIA driver): not an error */
} elastic_gpu_state;

/** Fault bits of elastic_gpu_report.faults. */
#define ELASTIC_GPU_FAULT_LOST 0x01u          /**< the device is lost (fell off the bus) */
#define ELASTIC_GPU_FAULT_XID 0x02u           /**< a critical XID error was reported */
#define ELASTIC_GPU_FAULT_ECC 0x04u           /**< uncorrectable (volatile) ECC errors */
#define ELASTIC_GPU_FAULT_RETIRED_PAGES 0x08u /**< page retirement pending (needs a reset) */
#define ELASTIC_GPU_FAULT_ROW_REMAP 0x10u     /**< row remapping failed or is pending */
#define ELASTIC_GPU_FAULT_THERMAL 0x20u       /**< thermal slowdown (software or hardware) */
#define ELASTIC_GPU_FAULT_HW_SLOWDOWN 0x40u   /**< hardware slowdown or power brake */

/** Result of checking one device. */
typedef struct elastic_gpu_report {
  int32_t device;          /**< NVML index */
  int32_t state;           /**< an elastic_gpu_state */
  uint32_t faults;         /**< ELASTIC_GPU_FAULT_* bits */
  uint32_t last_xid;       /**< the last critical XID seen, 0 if none */
  uint64_t ecc_uncorrected;/**< volatile uncorrectable ECC error count */
  uint64_t time_ns;        /**< when the check finished */
  char detail[256];        /**< human-readable explanation, NUL-terminated */
} elastic_gpu_report;

typedef struct elastic_gpu_health elastic_gpu_health;

/**
 * Load NVML from `library` (NULL: $ELASTIC_NVML_LIBRARY, else "libnvidia-ml.so.1") and initialise
 * it, waiting at most `timeout_ms` for nvmlInit. A missing library is not an error: the handle is
 * made and reports ELASTIC_GPU_NOT_AVAILABLE. NVML calls run on a helper thread, so a call that
 * never returns marks the state UNKNOWN instead of blocking the caller.
 */
ELASTIC_API int elastic_gpu_health_create(const char* library, int timeout_ms,
                                          elastic_gpu_health** out);

/** Release. A helper thread stuck inside NVML is abandoned (and the library left loaded). */
ELASTIC_API void elastic_gpu_health_destroy(elastic_gpu_health* gpu);

/** HEALTHY when NVML is loaded and initialised, else NOT_AVAILABLE or UNKNOWN. */
ELASTIC_API int elastic_gpu_health_state(const elastic_gpu_health* gpu);

/** Why the state is what it is (library path, NVML error string). */
ELASTIC_API const char* elastic_gpu_health_detail(const elastic_gpu_health* gpu);

/** Number of devices (0 when not available). */
ELASTIC_API uint32_t elastic_gpu_health_device_count(const elastic_gpu_health* gpu);

/**
 * Run every check on `device`, waiting at most `timeout_ms`. A timeout is not an error: the report
 * says UNKNOWN and why. XID errors are collected between calls.
 */
ELASTIC_API int elastic_gpu_health_check(elastic_gpu_health* gpu, uint32_t device, int timeout_ms,
                                         elastic_gpu_report* out);

/* ---------------------------------------------------------------------------------------------
 * Barriers
 * ------------------------------------------------------------------------------------------- */

typedef struct elastic_barrier elastic_barrier;

/**
 * Create a shared-memory barrier for `parties` processes at `path` (normally under /dev/shm). The
 * creator is not a participant unless it also calls elastic_barrier_open; destroying the creating
 * handle removes the file.
 */
ELASTIC_API int elastic_barrier_create(const char* path, uint32_t parties, elastic_barrier** out);

/** Join the barrier at `path` as participant `index` (0 .. parties-1). */
ELASTIC_API int elastic_barrier_open(const char* path, uint32_t index, elastic_barrier** out);

/** Unmap; if this handle created the barrier, remove its file. NULL is allowed. */
ELASTIC_API void elastic_barrier_destroy(elastic_barrier* barrier);

/**
 * Wait until every participant has arrived, at most `timeout_ms` (negative: no limit). Reusable
 * round after round. Returns ELASTIC_ERR_ABORTED when the barrier was aborted (the message names
 * the participant and why) and ELASTIC_ERR_TIMEOUT when time ran out (the message names who had
 * not arrived); both leave the barrier broken until elastic_barrier_reset.
 */
ELASTIC_API int elastic_barrier_wait(elastic_barrier* barrier, int timeout_ms);

/** Abort: every current and future waiter returns ELASTIC_ERR_ABORTED naming `participant`. */
ELASTIC_API int elastic_barrier_abort(elastic_barrier* barrier, int32_t participant,
                                      const char* reason);

/** Make a broken barrier usable again (call when no participant is waiting). */
ELASTIC_API int elastic_barrier_reset(elastic_barrier* barrier);

/** Number of completed rounds. */
ELASTIC_API uint64_t elastic_barrier_rounds(const elastic_barrier* barrier);

typedef struct elastic_tcp_barrier elastic_tcp_barrier;

/**
 * A barrier among `npeers` node leaders, given as "host:port" strings; `rank` is this node's
 * index. Rank 0 listens on its own address, the others connect to it, retrying until
 * `connect_timeout_ms`. `token` (may be NULL) must be the same on every peer: rank 0 and each
 * peer prove to each other that they hold it (HMAC-SHA256 over fresh nonces; it is never sent).
 * An unreachable peer is an ELASTIC_ERR_NETWORK or ELASTIC_ERR_TIMEOUT whose message names it.
 */
ELASTIC_API int elastic_tcp_barrier_create(const char* const* peers, uint32_t npeers,
                                           uint32_t rank, const char* token,
                                           int connect_timeout_ms, elastic_tcp_barrier** out);

/** One round; at most `timeout_ms`. A peer that fails or leaves is named in the message. */
ELASTIC_API int elastic_tcp_barrier_wait(elastic_tcp_barrier* barrier, int timeout_ms);

/** Close every connection. NULL is allowed. */
ELASTIC_API void elastic_tcp_barrier_destroy(elastic_tcp_barrier* barrier);

/* ---------------------------------------------------------------------------------------------
 * Watchdog
 * ------------------------------------------------------------------------------------------- */

/** Kinds of events. */
typedef enum elastic_event_kind {
  ELASTIC_EVENT_EXITED = 1,       /**< the process ended; exit_code or signal set when known */
  ELASTIC_EVENT_HUNG = 2,         /**< no beat for longer than the worker's timeout */
  ELASTIC_EVENT_GPU_UNHEALTHY = 3, /**< a GPU check found a fault (gpu, detail) */
  ELASTIC_EVENT_BAD_HEARTBEAT = 4  /**< the worker's heartbeat slot cannot be trusted: its file
                                        was truncated, replaced or overwritten (detail says how) */
} elastic_event_kind;

/** One finding of the watchdog. */
typedef struct elastic_event {
  int32_t worker;     /**< worker id given to elastic_watchdog_watch, -1 if none applies */
  int32_t kind;       /**< an elastic_event_kind */
  uint64_t time_ns;   /**< when the watchdog saw it (elastic_now_ns clock) */
  int32_t pid;        /**< the worker's pid, 0 if none applies */
  int32_t exit_code;  /**< EXITED: exit status if it exited normally, else -1 */
  int32_t signal;     /**< EXITED: terminating signal, 0 if none or unknown */
  int32_t gpu;        /**< GPU_UNHEALTHY: device index, else -1 */
  uint64_t step;      /**< HUNG: last step beaten */
  char detail[256];   /**< human-readable explanation, NUL-terminated */
} elastic_event;

/** Called on the watchdog's thread for each event; must not block for long. */
typedef void (*elastic_event_callback)(const elastic_event* event, void* user_data);

/** How process death is seen. */
typedef enum elastic_death_detection {
  ELASTIC_DEATH_AUTO = 0,  /**< pidfd if the kernel has it (Linux >= 5.3), else poll */
  ELASTIC_DEATH_PIDFD = 1, /**< pidfd_open + epoll: the instant the process exits */
  ELASTIC_DEATH_POLL = 2   /**< check every poll_interval_ms (fallback) */
} elastic_death_detection;

typedef struct elastic_watchdog_options {
  uint32_t struct_size;          /**< sizeof(elastic_watchdog_options) */
  uint64_t default_hang_timeout_ms; /**< used when neither watch() nor the worker sets one; 0 = off */
  uint32_t hang_check_interval_ms;  /**< how often heartbeats are compared; 0 = automatic */
  int32_t death_detection;          /**< an elastic_death_detection */
  uint32_t poll_interval_ms;        /**< for ELASTIC_DEATH_POLL; default 5 */
  int32_t reap;                     /**< 1: the watchdog reaps exited children (waitid) itself;
                                         0 (default): it reads their status without reaping,
                                         leaving that to the owner */
  uint32_t gpu_check_interval_ms;   /**< 0 = no GPU checks (default) */
  int32_t gpu_check_timeout_ms;     /**< deadline of one round of GPU checks; default 2000 */
  uint32_t queue_capacity;          /**< events kept for elastic_watchdog_next_event; default
                                         1024, oldest dropped beyond it */
} elastic_watchdog_options;

/** Fill `options` with the defaults. */
ELASTIC_API void elastic_watchdog_options_init(elastic_watchdog_options* options);

typedef struct elastic_watchdog elastic_watchdog;

/** Make a watchdog (not started). `options` may be NULL for the defaults. */
ELASTIC_API int elastic_watchdog_create(const elastic_watchdog_options* options,
                                        elastic_watchdog** out);

/** Stop (if running) and release. NULL is allowed. */
ELASTIC_API void elastic_watchdog_destroy(elastic_watchdog* watchdog);

/** Set the event callback (NULL to remove). Safe while running. */
ELASTIC_API int elastic_watchdog_set_callback(elastic_watchdog* watchdog,
                                              elastic_event_callback callback, void* user_data);

/**
 * Watch process `pid` as worker `worker` (an id of the caller's choosing, >= 0, unique). With a
 * table and a slot (>= 0), hangs are checked against a timeout: the worker's own (set with
 * elastic_heartbeat_set_timeout) if it set one, else `hang_timeout_ms`, else the options'
 * default; 0 everywhere means no hang check. A worker that has never beaten is only checked for
 * liveness. `gpu` is the device it uses (-1 none): GPU faults on it are reported for this worker.
 * The table must outlive the watch.
 */
ELASTIC_API int elastic_watchdog_watch(elastic_watchdog* watchdog, int32_t worker, int32_t pid,
                                       const elastic_heartbeat_table* table, int32_t slot,
                                       uint64_t hang_timeout_ms, int32_t gpu);

/**
 * Change the hang timeout given to elastic_watchdog_watch for a watched worker (a supervisor that
 * learns step times adjusts it as it goes). ELASTIC_ERR_NOT_FOUND if it is not watched.
 */
ELASTIC_API int elastic_watchdog_set_hang_timeout(elastic_watchdog* watchdog, int32_t worker,
                                                  uint64_t hang_timeout_ms);

/** Stop watching a worker. ELASTIC_ERR_NOT_FOUND if it is not watched (or already exited). */
ELASTIC_API int elastic_watchdog_unwatch(elastic_watchdog* watchdog, int32_t worker);

/** Watch GPUs through this NVML handle (must outlive the watchdog's run). */
ELASTIC_API int elastic_watchdog_set_gpu_health(elastic_watchdog* watchdog,
                                                elastic_gpu_health* gpu);

/**
 * Abort `barrier` (naming the worker) whenever a watched worker exits or hangs. The barrier must
 * outlive the watchdog's run. The worker id is used as the participant index.
 */
ELASTIC_API int elastic_watchdog_attach_barrier(elastic_watchdog* watchdog,
                                                elastic_barrier* barrier);

/** Start the watchdog thread. */
ELASTIC_API int elastic_watchdog_start(elastic_watchdog* watchdog);

/** Stop and join the thread; idempotent. Workers stay registered. */
ELASTIC_API int elastic_watchdog_stop(elastic_watchdog* watchdog);

/**
 * Take the oldest queued event, waiting at most `timeout_ms` (negative: until one arrives or the
 * watchdog stops). ELASTIC_ERR_TIMEOUT if none came; ELASTIC_ERR_STATE if stopped and empty.
 */
ELASTIC_API int elastic_watchdog_next_event(elastic_watchdog* watchdog, elastic_event* out,
                                            int timeout_ms);

/** Number of events dropped because the queue was full. */
ELASTIC_API uint64_t elastic_watchdog_dropped_events(const elastic_watchdog* watchdog);

/** The death detection in use: ELASTIC_DEATH_PIDFD or ELASTIC_DEATH_POLL. */
ELASTIC_API int elastic_watchdog_death_detection(const elastic_watchdog* watchdog);

/**
 * Make the calling process receive `sig` when its parent exits (Linux PR_SET_PDEATHSIG), so that
 * a worker never outlives a supervisor that was killed. With `expected_parent` > 0, returns
 * ELASTIC_ERR_NOT_FOUND if the parent is already another process (it died before the call):
 * the caller should then exit.
 */
ELASTIC_API int elastic_die_with_parent(int sig, int32_t expected_parent);

/** Short name of an event kind ("EXITED", "HUNG", "GPU_UNHEALTHY"). Static storage. */
ELASTIC_API const char* elastic_event_kind_name(int kind);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* ELASTIC_ELASTIC_H */
