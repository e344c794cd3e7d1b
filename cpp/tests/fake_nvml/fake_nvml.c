/*
 * A fake libnvidia-ml.so.1 for tests on machines without a GPU. It exports the NVML entry points
 * ElasticCore uses, and answers from a script file named by $ELASTIC_FAKE_NVML_SCRIPT, read at
 * every call so that a test can change the answers while the library is loaded. One directive
 * per line ("DEV" is a device index; no script file means two healthy devices):
 *
 *   devices N         number of GPUs (default 2)
 *   init_fail CODE    nvmlInit_v2 returns CODE (for example 9, driver not loaded)
 *   init_hang MS      nvmlInit_v2 sleeps MS milliseconds before succeeding
 *   query_hang MS     every device query sleeps MS milliseconds
 *   lost DEV          device queries return NVML_ERROR_GPU_IS_LOST
 *   xid XID DEV       one XID critical-error event for DEV, delivered once per nvmlInit
 *   ecc COUNT DEV     COUNT volatile uncorrectable ECC errors
 *   retired DEV       retired pages pending
 *   remap_failure DEV row remapping failed
 *   remap_pending DEV row remapping pending
 *   thermal DEV       software thermal slowdown
 *   hw_slowdown DEV   hardware slowdown
 */
#define _POSIX_C_SOURCE 200809L
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

typedef int nvmlReturn_t;
typedef struct fake_device* nvmlDevice_t;
typedef struct fake_set* nvmlEventSet_t;
typedef struct {
  nvmlDevice_t device;
  unsigned long long eventType;
  unsigned long long eventData;
  unsigned int gpuInstanceId;
  unsigned int computeInstanceId;
} nvmlEventData_t;

enum { OK = 0, UNINITIALIZED = 1, INVALID_ARGUMENT = 2, TIMEOUT = 10, GPU_IS_LOST = 15 };
#define MAX_DEVICES 16

struct fake_device {
  int index;
};
static struct fake_device devices[MAX_DEVICES];
static int initialised = 0;
static int xid_delivered = 0;
static int event_set_token;

struct script {
  int devices;
  int init_fail, init_hang_ms, query_hang_ms;
  int lost[MAX_DEVICES];
  int xid[MAX_DEVICES];
  unsigned long long ecc[MAX_DEVICES];
  int retired[MAX_DEVICES], remap_failure[MAX_DEVICES], remap_pending[MAX_DEVICES];
  int thermal[MAX_DEVICES], hw_slowdown[MAX_DEVICES];
};

static int valid(int dev) { return dev >= 0 && dev < MAX_DEVICES; }

static struct script load(void) {
  struct script s;
  memset(&s, 0, sizeof(s));
  s.devices = 2;
  const char* path = getenv("ELASTIC_FAKE_NVML_SCRIPT");
  FILE* f = path ? fopen(path, "r") : NULL;
  if (!f) return s;
  char line[256];
  while (fgets(line, sizeof(line), f)) {
    char word[64];
    long a = 0, b = 0;
    int n = sscanf(line, "%63s %ld %ld", word, &a, &b);
    if (n < 1 || word[0] == '#') continue;
    if (!strcmp(word, "devices")) s.devices = (int)a;
    else if (!strcmp(word, "init_fail")) s.init_fail = (int)a;
    else if (!strcmp(word, "init_hang")) s.init_hang_ms = (int)a;
    else if (!strcmp(word, "query_hang")) s.query_hang_ms = (int)a;
    else if (!strcmp(word, "lost") && valid((int)a)) s.lost[a] = 1;
    else if (!strcmp(word, "xid") && n == 3 && valid((int)b)) s.xid[b] = (int)a;
    else if (!strcmp(word, "ecc") && n == 3 && valid((int)b)) s.ecc[b] = (unsigned long long)a;
    else if (!strcmp(word, "retired") && valid((int)a)) s.retired[a] = 1;
    else if (!strcmp(word, "remap_failure") && valid((int)a)) s.remap_failure[a] = 1;
    else if (!strcmp(word, "remap_pending") && valid((int)a)) s.remap_pending[a] = 1;
    else if (!strcmp(word, "thermal") && valid((int)a)) s.thermal[a] = 1;
    else if (!strcmp(word, "hw_slowdown") && valid((int)a)) s.hw_slowdown[a] = 1;
  }
  fclose(f);
  if (s.devices < 0) s.devices = 0;
  if (s.devices > MAX_DEVICES) s.devices = MAX_DEVICES;
  return s;
}

static void sleep_ms(int ms) {
  struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
  while (nanosleep(&ts, &ts) != 0) {
  }
}

/* Common prologue of device queries: returns the script, or an error code in *rc. */
static int device_query(nvmlDevice_t device, struct script* s) {
  *s = load();
  if (!initialised) return UNINITIALIZED;
  if (!device) return INVALID_ARGUMENT;
  if (s->query_hang_ms > 0) sleep_ms(s->query_hang_ms);
  if (s->lost[device->index]) return GPU_IS_LOST;
  return OK;
}

nvmlReturn_t nvmlInit_v2(void) {
  struct script s = load();
  if (s.init_hang_ms > 0) sleep_ms(s.init_hang_ms);
  if (s.init_fail) return s.init_fail;
  if (initialised++ == 0) xid_delivered = 0; /* reference-counted, like NVML */
  return OK;
}

nvmlReturn_t nvmlShutdown(void) {
  if (!initialised) return UNINITIALIZED;
  --initialised;
  return OK;
}

const char* nvmlErrorString(nvmlReturn_t rc) {
  switch (rc) {
    case OK: return "Success";
    case UNINITIALIZED: return "Uninitialized";
    case 9: return "Driver Not Loaded";
    case TIMEOUT: return "Timeout";
    case GPU_IS_LOST: return "GPU is lost";
    default: return "Unknown Error";
  }
}

nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int* count) {
  struct script s = load();
  if (!initialised) return UNINITIALIZED;
  *count = (unsigned int)s.devices;
  return OK;
}

nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int index, nvmlDevice_t* device) {
  struct script s = load();
  if (!initialised) return UNINITIALIZED;
  if (index >= (unsigned int)s.devices) return INVALID_ARGUMENT;
  devices[index].index = (int)index;
  *device = &devices[index];
  if (s.lost[index]) return GPU_IS_LOST;
  return OK;
}

nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t device, char* uuid, unsigned int length) {
  struct script s;
  int rc = device_query(device, &s);
  if (rc != OK) return rc;
  snprintf(uuid, length, "GPU-fake-%d", device->index);
  return OK;
}

nvmlReturn_t nvmlDeviceGetTotalEccErrors(nvmlDevice_t device, int type, int counter,
                                         unsigned long long* count) {
  struct script s;
  int rc = device_query(device, &s);
  if (rc != OK) return rc;
  *count = (type == 1 && counter == 0) ? s.ecc[device->index] : 0;
  return OK;
}

nvmlReturn_t nvmlDeviceGetRetiredPagesPendingStatus(nvmlDevice_t device, int* pending) {
  struct script s;
  int rc = device_query(device, &s);
  if (rc != OK) return rc;
  *pending = s.retired[device->index];
  return OK;
}

nvmlReturn_t nvmlDeviceGetRemappedRows(nvmlDevice_t device, unsigned int* corr, unsigned int* unc,
                                       unsigned int* pending, unsigned int* failure) {
  struct script s;
  int rc = device_query(device, &s);
  if (rc != OK) return rc;
  *corr = 0;
  *unc = (unsigned int)(s.remap_failure[device->index] || s.remap_pending[device->index]);
  *pending = (unsigned int)s.remap_pending[device->index];
  *failure = (unsigned int)s.remap_failure[device->index];
  return OK;
}

nvmlReturn_t nvmlDeviceGetCurrentClocksEventReasons(nvmlDevice_t device,
                                                    unsigned long long* reasons) {
  struct script s;
  int rc = device_query(device, &s);
  if (rc != OK) return rc;
  *reasons = 0x1; /* GPU idle */
  if (s.thermal[device->index]) *reasons |= 0x20;
  if (s.hw_slowdown[device->index]) *reasons |= 0x8;
  return OK;
}

nvmlReturn_t nvmlEventSetCreate(nvmlEventSet_t* set) {
  if (!initialised) return UNINITIALIZED;
  *set = (nvmlEventSet_t)&event_set_token;
  return OK;
}

nvmlReturn_t nvmlDeviceRegisterEvents(nvmlDevice_t device, unsigned long long types,
                                      nvmlEventSet_t set) {
  (void)device;
  (void)types;
  return set ? OK : INVALID_ARGUMENT;
}

nvmlReturn_t nvmlEventSetWait_v2(nvmlEventSet_t set, nvmlEventData_t* data, unsigned int ms) {
  struct script s = load();
  if (!set) return INVALID_ARGUMENT;
  if (!initialised) return UNINITIALIZED;
  for (int i = 0; i < s.devices && !xid_delivered; ++i) {
    if (s.xid[i]) {
      xid_delivered = 1;
      memset(data, 0, sizeof(*data));
      devices[i].index = i;
      data->device = &devices[i];
      data->eventType = 0x8;
      data->eventData = (unsigned long long)s.xid[i];
      return OK;
    }
  }
  if (ms > 0) sleep_ms((int)(ms < 50 ? ms : 50));
  return TIMEOUT;
}

nvmlReturn_t nvmlEventSetFree(nvmlEventSet_t set) { return set ? OK : INVALID_ARGUMENT; }
